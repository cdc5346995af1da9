"""The engine's blocking conveniences, built on its thread-safe submission and its tick: run what is queued
to the end, generate a list of prompts, stream one prompt's text."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from cobali.backends.base import SamplingParams
from cobali.engine.request import FinishReason, Request


class Driving:
    """Mixed into Engine (not imported here: the engine imports this module), whose step, has_work, add_request,
    scheduler and clock these use."""

    def run_until_done(self, on_finish: Callable[[Request], None] | None = None) -> None:
        pending = list(self._inbox) + self.scheduler.running + list(self.scheduler.waiting)
        while self.has_work:
            self.step()
            if on_finish is not None:
                for request in [r for r in pending if r.is_finished]:
                    on_finish(request)
                pending = [r for r in pending if not r.is_finished]

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None
                 ) -> list[Request]:
        """Run prompts to completion. A prompt that cannot run comes back FAILED with its error."""
        requests = [self.submit(p, params) for p in prompts]
        self.run_until_done()
        return requests

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               arrival_time: float | None = None) -> Request:
        """Like add_request, but a prompt that cannot run becomes a FAILED request instead of raising."""
        try:
            return self.add_request(prompt, params, arrival_time=arrival_time)
        except ValueError as err:
            request = Request(next(self._ids), [], params or SamplingParams())
            request.finish(FinishReason.ERROR, self.clock(), str(err))
            return request

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt on the caller's thread, yielding text as it is produced."""
        deltas: deque[str] = deque()
        request = self.add_request(prompt, params, on_token=lambda _r, d, _n: deltas.append(d))
        while deltas or not request.is_finished:
            if not deltas:
                self.step()
            elif delta := deltas.popleft():
                yield delta

