"""The engine on a thread of its own, fed by the asyncio server.

The thread loads the model, then ticks while there is work and sleeps on an Event when idle. HTTP handlers
submit from the event loop (Engine.add_request is thread-safe); the engine hands each tick's outputs
(RequestOutput messages) to this client as soon as they are made, and they hop back onto the loop in one
call_soon_threadsafe per tick (one wake-up of the loop for hundreds of streams, not one per token) into one
inbox per HTTP request. A stream reads everything its inbox holds at once, so a loop that falls behind catches
up in fewer, larger writes.

With a stream interval N > 1 the engine hands a request's text over once N tokens have come since its last
output (and decodes it only then); its first text and its end never wait. Every delta costs the event loop a
wake-up, a chunk and a socket write, so this trades smoothness for how many streams one loop can serve
(SGLang's and vLLM's --stream-interval). If the thread dies, every pending request is told so, and the server
reports unhealthy instead of leaving clients hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from cobali.engine.engine import Engine
from cobali.engine.outputs import EngineStats, RequestOutput
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo, SlotState
from cobali.frontend.generation import EngineUnavailable, Failure, Generation
from cobali.structured.compiler import GrammarCompiler

SAVE_AFTER_IDLE_S = 0.05
# What clients are told of a failed engine: its exception text is the log's alone (paths, device details).
ENGINE_FAILED = "the engine failed; see the server log"

log = logging.getLogger("cobali.http")


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # shutting down: in-flight requests finish, new ones are refused
    FAILED = "failed"
    STOPPED = "stopped"


class QueueFull(Exception):
    """More requests in flight than the slots plus the --max-queue limit."""


class Observer(Protocol):
    """Metrics and logging hooks, called on the engine's threads."""

    def attach(self, stats: Callable[[], EngineStats]) -> None:
        """Once the model is loaded: where the engine's gauges and totals are read (a snapshot, any thread)."""

    def tick_done(self, record: TickRecord) -> None: ...

    def request_finished(self, output: RequestOutput) -> None:
        """A request's final output (with its stats)."""


class EngineClient:
    def __init__(self, factory: Callable[[], Engine], max_queue: int | None = None,
                 observer: Observer | None = None, idle_wait_s: float = 0.5, stream_interval: int = 1) -> None:
        assert stream_interval >= 1, stream_interval
        self._factory = factory
        self.stream_interval = stream_interval
        self.max_queue = max_queue
        self.observer = observer
        self.idle_wait_s = idle_wait_s  # only bounds how late a missed wake-up could be noticed
        self.engine: Engine | None = None
        self._model_info: ModelInfo | None = None  # set on load, before the engine is ready
        self._embedding = asyncio.Lock()  # one embeddings call at a time: the backend has one context for them
        self.state = EngineState.LOADING
        self.error: str | None = None
        self.on_load_failed: Callable[[str], None] | None = None
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _live between the loop thread and the engine thread
        self._live: dict[int, Generation] = {}
        self._calls: deque[tuple[Callable[[Engine], Any], asyncio.Future]] = deque()  # see call()
        self._abort_at: float | None = None  # end of the drain's grace period
        self._thread = threading.Thread(target=self._run, name="cobali-engine", daemon=True)

    # ---- lifecycle (event-loop side) ---------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def drain(self, grace_s: float | None = None) -> None:
        """Refuse new requests; abort those still running after grace_s (None: let them finish)."""
        if self.state in (EngineState.LOADING, EngineState.READY):
            self.state = EngineState.DRAINING
        if grace_s is not None:
            self._abort_at = time.monotonic() + grace_s
            self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, end the thread. In-flight work should have been drained before this."""
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def require_engine(self) -> Engine:
        if self.state is EngineState.READY and self.engine is not None:
            return self.engine
        if self.state is EngineState.LOADING:
            raise EngineUnavailable("the model is loading")
        if self.state is EngineState.FAILED:
            raise EngineUnavailable(ENGINE_FAILED)
        raise EngineUnavailable("the server is shutting down")

    # ---- the loaded model (from any thread, once the engine is ready) -------------------------------

    @property
    def model_info(self) -> ModelInfo:
        """The loaded model's limits; EngineUnavailable unless the engine is ready."""
        self.require_engine()
        assert self._model_info is not None, "set before the engine is ready"
        return self._model_info

    @property
    def tokenizer(self) -> Tokenizer:
        """The loaded model's text side: thread-safe, for the worker pool."""
        return self.require_engine().tokenizer

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler the engine's constraints come from: a grammar compiled here first fails before it runs."""
        return self.require_engine().grammars

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings, one row per input (each within model_info.embeddings), computed on a worker thread
        beside the ticks (never on the event loop), one call at a time."""
        engine = self.require_engine()
        async with self._embedding:
            return await asyncio.to_thread(engine.embed, inputs)

    def slot_states(self) -> asyncio.Future[tuple[SlotState, ...]]:
        """A snapshot of every slot, taken on the engine thread between two ticks."""
        return self.call(Engine.slot_states)

    def load_adapter(self, path: str) -> asyncio.Future[int]:
        """Load a LoRA adapter between two ticks; the future gets its index, or FileNotFoundError, ValueError
        (not an adapter for this model) or AdapterLimit."""
        return self.call(lambda engine: engine.load_adapter(path))

    def unload_adapter(self, index: int) -> asyncio.Future[None]:
        """No new request runs with the adapter; the engine frees it when its last request ends."""
        return self.call(lambda engine: engine.unload_adapter(index))

    # ---- requests (event-loop side) ----------------------------------------------------------------

    def submit(self, prompts: list[tuple[list[int], SamplingParams]], priority: int = 0, lora: int = 0) -> Generation:
        """Queue one engine request per (prompt tokens, params), all or none, with LoRA adapter `lora` (0: none).
        Call from the event loop."""
        generation = Generation(asyncio.get_running_loop(), self)
        with self._lock:  # the engine's outputs find their generation under it: none comes before it is known
            engine = self.require_engine()
            self._check_room(engine, len(prompts))
            arrival = time.perf_counter()
            for tokens, params in prompts:
                request_id = engine.add_request(tokens, params, arrival_time=arrival, priority=priority,
                                                stream_interval=self.stream_interval, lora=lora).id
                generation.add(request_id, len(tokens))
                self._live[request_id] = generation
        self._wake.set()
        return generation

    def check_room(self, n_requests: int) -> None:
        """QueueFull now if n_requests more could not be queued: a full server refuses a request before its
        tokenizing, template and grammar cost anything (submit checks again)."""
        self._check_room(self.require_engine(), n_requests)

    def _check_room(self, engine: Engine, n_requests: int) -> None:
        if self.max_queue is not None:
            # Everything beyond the slots is waiting, so this bounds the queue without reading it.
            capacity = engine.config.max_slots + self.max_queue
            if len(self._live) + n_requests > capacity:
                raise QueueFull(f"the server is busy: {len(self._live)} requests in flight, "
                                f"{engine.config.max_slots} slots, queue limit {self.max_queue}")

    def call(self, work: Callable[[Engine], Any]) -> asyncio.Future:
        """Run work(engine) on the engine thread between two ticks (the backend is that thread's alone); the
        future gets its result or its exception. Call from the event loop."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self.require_engine()
            self._calls.append((work, future))
        self._wake.set()
        return future

    def abort(self, request_id: int) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)
            self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
            self._model_info = model = engine.model_info()
        except Exception as err:
            self._fail(f"loading failed: {err}", loading=True)
            return
        if self.observer is not None:
            self.observer.attach(engine.stats)
            engine.on_tick = self.observer.tick_done
        with contextlib.suppress(NotImplementedError):  # a backend that takes no constraints
            _ = engine.grammars.tokenizer  # the vocabulary read now, not on a first constraint: that holds the GIL
        settle_heap()
        # With async scheduling the host thread makes a decode's outputs while the next decode runs: handed to
        # the loop there, they go out a decode earlier, and the thread that launches decodes does less.
        engine.on_outputs = self._hand_over
        self.engine = engine
        if self.state is EngineState.LOADING:
            self.state = EngineState.READY
        log.info("engine ready: %s, %d slots", model.description, model.max_slots)
        try:
            self._loop(engine)
            self._abort_all(engine)
        except Exception as err:
            log.exception("the engine thread crashed")
            self._fail(f"{type(err).__name__}: {err}")

    def _loop(self, engine: Engine) -> None:
        idle_since: float | None = None
        while self.state is not EngineState.STOPPED:
            self._wake.clear()  # before the check, so a submit racing with it still wakes the wait
            self._run_calls(engine)
            if self._abort_at is not None and time.monotonic() >= self._abort_at:
                self._abort_at = None
                self._abort_live(engine)
            if engine.has_work:
                self._tick(engine)
                idle_since = None
                continue
            idle_since = time.monotonic() if idle_since is None else idle_since
            idle_for = time.monotonic() - idle_since
            # Cached prefixes go to host memory ahead of need only once the server has idled a while, one at a
            # time: a client that sends its next request at once must not wait for a save (a save in its way
            # doubled such a prompt's TTFT: docs/results.md).
            if idle_for < SAVE_AFTER_IDLE_S:
                self._wake.wait(SAVE_AFTER_IDLE_S - idle_for)
            elif not engine.save_a_cached_prefix():
                self._wake.wait(self.idle_wait_s)

    def _run_calls(self, engine: Engine) -> None:
        while self._calls:
            work, future = self._calls.popleft()
            try:
                outcome: tuple[Any, BaseException | None] = (work(engine), None)
            except Exception as err:  # the caller's to report (a bad adapter file is a 400)
                outcome = (None, err)
            _settle_soon(future, *outcome)

    def _abort_live(self, engine: Engine) -> None:
        with self._lock:
            ids = list(self._live)
        for request_id in ids:
            engine.abort(request_id)

    def _abort_all(self, engine: Engine) -> None:
        self._fail_calls("the server is shutting down")
        self._abort_live(engine)
        self._tick(engine)  # takes the aborts: slots freed, clients get their final (abort) output

    def _tick(self, engine: Engine) -> None:
        engine.step()  # its outputs come through _hand_over

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """Outputs just made, to their generations' event loops. Runs on one thread at a time: the engine's
        between two steps, the host thread inside one."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Generation, RequestOutput]]] = {}
        finished: list[RequestOutput] = []
        with self._lock:
            live = self._live
            for output in outputs:
                generation = live.pop(output.request_id, None) if output.finished else live.get(output.request_id)
                if generation is not None:  # None: the engine failed, and the client was told
                    by_loop.setdefault(generation.loop, []).append((generation, output))
                if output.finished:
                    finished.append(output)
        if self.observer is not None:
            for output in finished:
                self.observer.request_finished(output)
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
        self._fail_calls(ENGINE_FAILED)
        for generation in pending:
            generation.push(Failure(ENGINE_FAILED))
        if loading and self.on_load_failed is not None:
            self.on_load_failed(message)

    def _fail_calls(self, message: str) -> None:
        with self._lock:  # with call()'s check under the lock, no call is left waiting after this
            calls, self._calls = list(self._calls), deque()
        for _, future in calls:
            _settle_soon(future, None, EngineUnavailable(message))


def settle_heap() -> None:
    """Once the model and the app are loaded: what exists now lives as long as the server, so it is frozen out
    of the collector's scans, and a tick's thousands of short-lived objects start a pass every 50,000
    allocations instead of 700. With hundreds of streams the decode thread then waits less for the GIL, and the
    backend is busy a larger share of the time (bench/engine/sleeping_backend.py; docs/results.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def _settle_soon(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """From any thread: the future's outcome, set on its event loop (unless it was cancelled meanwhile)."""
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
        future.get_loop().call_soon_threadsafe(settle)


def _deliver(items: list[tuple[Generation, RequestOutput]]) -> None:
    """On the event loop: one tick's outputs into their generations' inboxes."""
    for generation, output in items:
        generation.put(output)
