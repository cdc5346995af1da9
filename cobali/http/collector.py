"""The cyclic garbage collector's pace while a server serves.

CPython collects its youngest generation after every 700 container objects allocated and not yet freed. A
server with hundreds of streams allocates in bursts (a tick's outputs reach every stream at once) whose objects
refcounting frees a moment later: at the default, each burst triggered collections that traversed every object
of the requests in flight, and promoted them, so older generations filled with objects already dead by the time
they were scanned. That was about a tenth of the server's CPU on short streamed requests
(bench/engine/sleeping_backend.py). Nothing on the request path relies on the cyclic collector (a request's
objects are freed by refcounting: tests/unit/http/test_collector.py), so while a server runs, its youngest
generation is collected after SERVING_THRESHOLD allocations instead: cyclic garbage from elsewhere is still
collected, after a burst that size.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

SERVING_THRESHOLD = 20_000


class _Pace:
    """The threshold held while any app runs (a server of many models starts and stops one per model), and the
    process's own put back when the last one stops."""

    def __init__(self) -> None:
        self.serving = 0
        self.before: tuple[int, int, int] = gc.get_threshold()

    @contextlib.contextmanager
    def serving_pace(self) -> Iterator[None]:
        if not self.serving:
            self.before = gc.get_threshold()
            gc.set_threshold(max(SERVING_THRESHOLD, self.before[0]), *self.before[1:])
        self.serving += 1
        try:
            yield
        finally:
            self.serving -= 1
            if not self.serving:
                gc.set_threshold(*self.before)


serving_pace = _Pace().serving_pace
