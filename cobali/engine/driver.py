"""Driving an engine through a long stream of requests without a long wait queue.

The engine's WaitQueue sorts on every push and scans on every remove, and run_until_done rescans its
pending list every tick; both are fine for a few hundred requests and quadratic for 10^5. The driver
holds requests in its own FIFO backlog and hands the engine only enough to keep admission busy (a tick
admits at most max_slots), and reports each request once, in the tick it finishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.engine.request import Request

FEED_PER_SLOT = 2
FEED_EXTRA = 8  # room for the queue's head-of-line bypass (WaitQueue.max_bypass)


@dataclass(frozen=True)
class Pending:
    key: Hashable  # the caller's name for the request, handed back when it finishes
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None = None  # None: when the engine takes it


class Driver:
    def __init__(self, engine: Engine, window: int | None = None) -> None:
        self.engine = engine
        self.window = window or FEED_PER_SLOT * engine.config.max_slots + FEED_EXTRA
        self.backlog: deque[Pending] = deque()
        self.live: dict[int, tuple[Hashable, Request]] = {}  # engine request id -> (key, request)
        self._refused: list[tuple[Hashable, Request]] = []

    def push(self, item: Pending) -> None:
        self.backlog.append(item)

    @property
    def has_work(self) -> bool:
        return bool(self.backlog or self._refused) or self.engine.has_work

    def step(self) -> list[tuple[Hashable, Request]]:
        """Feed the engine, run one tick, and return the (key, request) pairs that finished in it."""
        self._feed()
        done, self._refused = self._refused, []
        record = self.engine.step()
        running = self.engine.requests  # the engine forgets a request when it finishes
        # Requests that finish in a tick were in its plan; anything else (a request that can never fit the
        # KV, an abort) leaves the counts unequal and costs one scan.
        # (With async scheduling a request may ride one more tick's plan after it finished: counted once.)
        ids = [c.request_id for c in record.plan.chunks
               if c.request_id not in running and c.request_id in self.live] if record else []
        done += [self.live.pop(i) for i in ids]
        if len(self.live) > len(running):
            done += [self.live.pop(i) for i in [i for i in self.live if i not in running]]
        if record is None and not done and self.engine.has_work:
            raise RuntimeError("the engine has work but cannot run any of it")
        return done

    def _feed(self) -> None:
        engine = self.engine
        while self.backlog and len(engine.requests) - len(engine.scheduler.running) < self.window:
            item = self.backlog.popleft()
            request = engine.submit(item.prompt, item.params, arrival_time=item.arrival_time)
            if request.is_finished:  # refused at submission (e.g. longer than the context)
                self._refused.append((item.key, request))
            else:
                self.live[request.id] = (item.key, request)
