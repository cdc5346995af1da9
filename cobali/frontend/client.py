"""The frontend's side of the engine boundary: requests go to an engine core as messages, and each tick's outputs
come back as one message that hops onto the event loop in one call_soon_threadsafe (one wake-up of the loop for
hundreds of streams, not one per token) into one inbox per HTTP request. A stream reads everything its inbox
holds at once, so a loop that falls behind catches up in fewer, larger writes.

Where the core runs is the transport's business (transports.py): on a thread of this process, or in a process of
its own that a crash of llama.cpp cannot take the server down with. If that process dies, the requests that had
produced output end with a clean error, those that had not are sent again to the engine that replaces it, and
/health says "restarting" meanwhile.

With a stream interval N > 1 the engine hands a request's text over once N tokens have come since its last
output (and decodes it only then); its first text and its end never wait. Every delta costs the event loop a
wake-up, a chunk and a socket write, so this trades smoothness for how many streams one loop can serve
(SGLang's and vLLM's --stream-interval).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import NoReturn, Protocol

from cobali.engine.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    CallDone,
    Failed,
    FromCore,
    Outputs,
    Ready,
    Shutdown,
    TickSummary,
)
from cobali.engine.outputs import EngineStats, RequestOutput
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.frontend.engine_calls import EngineCalls
from cobali.frontend.generation import EngineUnavailable, Failure, Generation
from cobali.frontend.transports import Transport
from cobali.structured.compiler import GrammarCompiler

# What clients are told of a failed engine: its exception text is the log's alone (paths, device details).
ENGINE_FAILED = "the engine failed; see the server log"
ENGINE_RESTARTED = "the engine stopped while the request ran and is restarting; retry it"

log = logging.getLogger("cobali.http")


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"  # the engine's process died: a new one loads, requests not started wait for it
    DRAINING = "draining"  # shutting down: in-flight requests finish, new ones are refused
    FAILED = "failed"
    STOPPED = "stopped"


class QueueFull(Exception):
    """More requests in flight than the slots plus the --max-queue limit."""


class Observer(Protocol):
    """Metrics and logging hooks, called on the client's receiving thread."""

    def attach(self, stats: Callable[[], EngineStats | None]) -> None:
        """Once the model is loaded: where the engine's latest gauges and totals are read (any thread)."""

    def tick_done(self, tick: TickSummary) -> None: ...

    def requests_finished(self, outputs: list[RequestOutput]) -> None:
        """Requests' final outputs (with their stats), those of one message from the engine."""

    def engine_restarted(self) -> None: ...


class EngineClient(EngineCalls):
    """Requests and calls (engine_calls.py) to an engine core, and its outputs back to their generations."""

    def __init__(self, transport: Transport, max_queue: int | None = None, observer: Observer | None = None,
                 stream_interval: int = 1) -> None:
        """transport: where the engine core runs (ThreadCore, or engine_process.ProcessCore)."""
        assert stream_interval >= 1, stream_interval
        super().__init__(transport)
        self.stream_interval = stream_interval
        self.max_queue = max_queue
        self.observer = observer
        self._model_info: ModelInfo | None = None
        self._stats: EngineStats | None = None
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.on_load_failed: Callable[[str], None] | None = None
        self.on_ready: Callable[[], None] | None = None  # each time an engine is ready (after a restart too)
        # What follows is guarded by self._lock between the loop and receiving threads.
        self._live: dict[int, Generation] = {}
        self._not_started: dict[int, AddRequest] = {}  # requests not started: sent again to an engine that restarts

    # ---- lifecycle (event-loop side) ---------------------------------------------------------------

    def start(self) -> None:
        if self.observer is not None:
            self.observer.attach(lambda: self._stats)
        self.transport.start(self)

    def drain(self, grace_s: float | None = None) -> None:
        """Refuse new requests; abort those still running after grace_s (None: let them finish)."""
        if self.state in (EngineState.LOADING, EngineState.READY, EngineState.RESTARTING):
            self.state = EngineState.DRAINING
        if grace_s is not None:  # a timer thread: a drain may begin in a signal handler, outside the event loop
            timer = threading.Timer(grace_s, self.transport.send, (AbortAll(),))
            timer.daemon = True
            timer.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, end the core. In-flight work should have been drained before this."""
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED
        self.transport.send(Shutdown())
        self.transport.stop(timeout_s)
        self._fail_calls("the server is shutting down")

    def require_engine(self) -> None:
        """EngineUnavailable unless the engine runs now (/health: a restarting replica leaves rotation)."""
        if self.state is not EngineState.READY:
            self._unavailable()

    def require_accepting(self) -> None:
        """EngineUnavailable unless requests are taken now: the engine runs, or a new one is starting after a
        crash, and requests wait for it (its model is the same one: what was prepared for it still holds)."""
        if self.state is not EngineState.READY and self.state is not EngineState.RESTARTING:
            self._unavailable()

    def _unavailable(self) -> NoReturn:
        raise EngineUnavailable({EngineState.LOADING: "the model is loading",
                                 EngineState.RESTARTING: "the engine is restarting",
                                 EngineState.FAILED: ENGINE_FAILED}.get(self.state, "the server is shutting down"))

    # ---- the loaded model (from any thread, once the engine is ready) -------------------------------

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model's limits; EngineUnavailable unless requests are taken now."""
        self.require_accepting()
        assert self._model_info is not None, "set before the engine is ready"
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer:
        """The loaded model's text side: thread-safe, for the worker pool."""
        self.require_accepting()
        return self.transport.tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        """Constraints compiled here first: a grammar that fails, fails before it runs."""
        self.require_accepting()
        return self.transport.grammars

    # ---- requests (event-loop side) ----------------------------------------------------------------

    def submit(self, prompts: list[tuple[list[int], SamplingParams]], priority: int = 0, lora: int = 0) -> Generation:
        """Queue one engine request per (prompt tokens, params), all or none, with LoRA adapter `lora` (0: none).
        Call from the event loop."""
        generation = Generation(asyncio.get_running_loop(), self)
        arrival = time.perf_counter()
        messages = []
        with self._lock:  # the engine's outputs find their generation under it: none comes before it is known
            self.require_accepting()  # while the engine restarts, requests wait for the next one
            self._check_room(len(prompts))
            for tokens, params in prompts:
                message = AddRequest(next(self._ids), tokens, params, arrival, priority, self.stream_interval, lora)
                generation.add(message.request_id, len(tokens))
                self._live[message.request_id] = generation
                self._not_started[message.request_id] = message
                messages.append(message)
            send_now = self.state is EngineState.READY
        for message in messages if send_now else ():
            self.transport.send(message)
        return generation

    def check_room(self, n_requests: int) -> None:
        """QueueFull now if n_requests more could not be queued: a full server refuses a request before its
        tokenizing, template and grammar cost anything (submit checks again)."""
        self.require_accepting()
        self._check_room(n_requests)

    def _check_room(self, n_requests: int) -> None:
        if self.max_queue is not None:
            # Everything beyond the slots is waiting, so this bounds the queue without reading it.
            assert self._model_info is not None, "a request comes once the engine was ready"
            slots = self._model_info.max_slots
            if len(self._live) + n_requests > slots + self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._live)} requests in flight, "
                                f"{slots} slots, queue limit {self.max_queue}")

    def abort(self, request_id: int) -> None:
        with self._lock:
            if self.state is EngineState.RESTARTING and request_id in self._not_started:  # the next engine won't see it
                del self._not_started[request_id]
                self._live.pop(request_id, None)
                return
        self.transport.send(AbortRequest(request_id))

    # ---- what the core sends (its threads, or the transport's receiving thread) --------------------

    def receive(self, message: FromCore) -> None:
        if isinstance(message, Outputs):
            self._take(message)
        elif isinstance(message, CallDone):
            self._answered(message)
        elif isinstance(message, Ready):
            self._ready(message.model)
        else:
            assert isinstance(message, Failed), message
            self._fail(message.error, loading=message.loading)

    def core_lost(self, why: str) -> None:
        """The engine's process died: what had started ends with an error, the rest waits for the next engine."""
        log.error("the engine stopped (%s); restarting it", why)
        with self._lock:
            if self.state is EngineState.READY:
                self.state = EngineState.RESTARTING
            broken = {g for rid, g in self._live.items() if rid not in self._not_started}
            for generation in broken:
                for request_id in generation.request_ids:
                    self._live.pop(request_id, None)
                    self._not_started.pop(request_id, None)
        if self.observer is not None:  # counted before any client hears of it: one that then reads /metrics sees it
            self.observer.engine_restarted()
        self._fail_calls(ENGINE_RESTARTED)
        for generation in broken:
            generation.push(Failure(ENGINE_RESTARTED))

    def _ready(self, model: ModelInfo) -> None:
        with self._lock:
            self._model_info = model
            waiting = list(self._not_started.values())
            if self.state in (EngineState.LOADING, EngineState.RESTARTING):
                self.state = EngineState.READY
        for message in waiting:  # after a restart: those that had not started, in the order they came
            self.transport.send(message)
        if self.on_ready is not None:
            self.on_ready()
        log.info("engine ready: %s, %d slots", model.description, model.max_slots)

    def _take(self, message: Outputs) -> None:
        """Outputs just made, to their generations' event loops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, RequestOutput]]] = {}
        finished: list[RequestOutput] = []
        with self._lock:
            live, unsent = self._live, self._not_started
            if message.stats is not None:
                self._stats = message.stats
            for output in message.outputs:
                unsent.pop(output.request_id, None)
                generation = live.pop(output.request_id, None) if output.finished else live.get(output.request_id)
                if generation is not None:  # None: the engine failed, and the client was told
                    by_loop.setdefault(generation.loop, []).append((generation, output))
                if output.finished:
                    finished.append(output)
        if self.observer is not None:
            for tick in message.ticks:
                self.observer.tick_done(tick)
            if finished:
                self.observer.requests_finished(finished)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for generation, _ in items:
                    generation.abort()

    def _fail(self, message: str, loading: bool = False) -> None:
        log.error("engine unavailable: %s", message)
        with self._lock:  # with submit's re-check under the lock, no request slips in after this
            self.error = message
            self.state = EngineState.FAILED
            pending = set(self._live.values())
            self._live.clear()
            self._not_started.clear()
        self._fail_calls(ENGINE_FAILED)
        for generation in pending:
            generation.push(Failure(ENGINE_FAILED))
        if loading and self.on_load_failed is not None:
            self.on_load_failed(message)


def _deliver(items: list[tuple[Generation, RequestOutput]]) -> None:
    """On the event loop: one tick's outputs into their generations' inboxes."""
    for generation, output in items:
        generation.put(output)
