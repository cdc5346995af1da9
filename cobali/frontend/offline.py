"""The engine driven on the caller's thread: generate a list of prompts, stream one prompt's text, or run a
long stream of requests through a bounded feed window. The library under `cobali run`, batch jobs, the
simulator and the benchmarks."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass

from cobali.engine.engine import Engine
from cobali.engine.outputs import RequestOutput, refused
from cobali.engine.sampling_params import SamplingParams

# A long stream's feed window: enough waiting requests to keep admission busy (a tick admits at most
# max_slots), plus room for the wait queue's head-of-line bypass (WaitQueue.max_bypass). The engine's queue
# sorts on every push and scans on every remove: fine for a few hundred requests, quadratic for 10^5.
FEED_PER_SLOT = 2
FEED_EXTRA = 8


@dataclass(frozen=True)
class Pending:
    key: Hashable  # the caller's name for the request, handed back with its final output
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None = None  # None: when the engine takes it


class LLM:
    """Requests in, final outputs out. A request's final output here is its whole output (text, tokens,
    logprobs, stats): its text is handed out only at its end. A prompt that can never run comes back as a
    failed output (request_id < 0: never queued)."""

    def __init__(self, engine: Engine, window: int | None = None) -> None:
        """window: requests pushed and handed to the engine but not running yet, at most (the rest wait in a
        FIFO backlog); None: no bound."""
        assert engine.on_outputs is None, "the outputs are this driver's to read"
        self.engine = engine
        self.window = window
        self._backlog: deque[Pending] = deque()
        self._keys: dict[int, Hashable] = {}  # request id -> the key it was pushed with
        self._refused: list[RequestOutput] = []  # reported at the next step
        self._n_refused = 0

    @staticmethod
    def feed_window(engine: Engine) -> int:
        """A window that keeps admission busy (for run() over a long stream)."""
        return FEED_PER_SLOT * engine.config.max_slots + FEED_EXTRA

    def push(self, item: Pending) -> None:
        """Queue a request behind the window; its final output comes back from step() or run() with its key."""
        self._backlog.append(item)

    @property
    def has_work(self) -> bool:
        return bool(self._backlog or self._refused) or self.engine.has_work

    def step(self) -> list[tuple[Hashable, RequestOutput]]:
        """Feed the engine from the backlog and run one tick: the final outputs of the requests that ended in it,
        each with its key (a request added to the engine directly is keyed by its id)."""
        self._feed()
        return [(self._keys.pop(o.request_id, o.request_id), o) for o in self._tick() if o.finished]

    def run(self) -> Iterator[tuple[Hashable, RequestOutput]]:
        """step() until no work is left."""
        while self.has_work:
            yield from self.step()

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None,
                 arrival_time: float | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once, past any window): their final outputs, in order."""
        keys = [self.submit(prompt, params, arrival_time=arrival_time) for prompt in prompts]
        finished = dict(self.run())
        return [finished[key] for key in keys]

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               arrival_time: float | None = None, key: Hashable | None = None) -> Hashable:
        """Queue a request now, past any window; its key (by default its request id)."""
        try:
            request_id = self.engine.add_request(prompt, params, arrival_time=arrival_time).id
        except ValueError as err:
            self._n_refused += 1
            request_id = -self._n_refused
            self._refused.append(refused(request_id, str(err), self.engine.clock()))
        self._keys[request_id] = request_id if key is None else key
        return self._keys[request_id]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt, yielding its text as it is made. Raises ValueError for a prompt that cannot run."""
        request_id = self.engine.add_request(prompt, params, stream_interval=1).id
        while True:
            for output in self._tick():
                if output.request_id != request_id:
                    continue
                if output.text:
                    yield output.text
                if output.finished:
                    return

    def _tick(self) -> list[RequestOutput]:
        refused_now, self._refused = self._refused, []
        return refused_now + (self.engine.step() if self.engine.has_work else [])

    def _feed(self) -> None:
        engine, window = self.engine, self.window
        while self._backlog and (window is None or len(engine.requests) - len(engine.scheduler.running) < window):
            item = self._backlog.popleft()
            self.submit(item.prompt, item.params, arrival_time=item.arrival_time, key=item.key)
