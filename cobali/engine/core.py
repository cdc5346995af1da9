"""An engine behind its message boundary (messages.py): it takes a frontend's messages, ticks while there is
work, and sends back each tick's outputs, the ticks' summaries and its gauges, and the answers to calls. The
same core runs on a thread of the server's process or in a process of its own; only how messages travel
differs (cobali/frontend/transports.py)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cobali.engine.engine import Engine
from cobali.engine.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    Call,
    CallDone,
    Embed,
    FromCore,
    LoadAdapter,
    Outputs,
    ReadRoutingReport,
    ReadSlots,
    Ready,
    RoutingReport,
    Shutdown,
    TickSummary,
    ToCore,
    UnloadAdapter,
)
from cobali.engine.outputs import RequestOutput, refused
from cobali.engine.plan import TickRecord
from cobali.engine.prefix_digest import DigestBuilder

# Cached prefixes go to host memory ahead of need only once the engine has idled this long, one at a time: a
# client that sends its next request at once must not wait for a save (a save in its way doubled such a prompt's
# TTFT: docs/results.md).
SAVE_AFTER_IDLE_S = 0.05
IDLE_WAIT_S = 0.5  # only bounds how late a missed wake-up could be noticed
# The gauges ride along with outputs this often, with any output that ends a request, and when the engine idles.
STATS_EVERY_S = 0.05
# Routing reports' digests kept, one per (block_tokens, max_blocks) asked: each remembers the arrays of its last
# report (their hashes are reused). A deployment's routers ask in one shape; more are forgotten oldest first.
MAX_DIGESTS = 4

log = logging.getLogger("cobali.engine")

Receive = Callable[[float], list[ToCore]]  # the messages that came, waiting up to that many seconds for one


class EngineCore:
    def __init__(self, engine: Engine, send: Callable[[FromCore], None]) -> None:
        """send: thread-safe; called on the ticking thread, on the host thread inside a tick (async scheduling),
        and on the embeddings thread."""
        self.engine = engine
        self._send = send
        self._ticks: list[TickSummary] = []
        self._stats_sent_at = 0.0
        self._lock = threading.Lock()  # the ticks' summaries: added on one thread, sent from another
        self._embedder = ThreadPoolExecutor(1, thread_name_prefix="cobali-embed")  # beside the ticks, one at a time
        self._digests: dict[tuple[int, int], DigestBuilder] = {}
        self.stopping = False
        engine.on_tick = self._tick_done
        engine.on_outputs = self._hand_out

    def announce(self) -> None:
        """The engine's gauges, then Ready: a frontend that sees it ready has them too."""
        self._hand_out([], force_stats=True)
        self._send(Ready(self.engine.model_info()))

    def run(self, receive: Receive) -> None:
        """Until a Shutdown: take messages, tick while there is work, and idle with a wait on `receive`."""
        idle_since: float | None = None
        while not self.stopping:
            wait = 0.0
            if not self.engine.has_work:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since < SAVE_AFTER_IDLE_S:
                    wait = SAVE_AFTER_IDLE_S - (now - idle_since)
                elif self.engine.save_a_cached_prefix():
                    self._hand_out([], force_stats=True)  # the host cache grew: its gauge with it
                else:
                    wait = IDLE_WAIT_S
            for message in receive(wait):
                self.handle(message)
            if self.engine.has_work:
                self.engine.step()
                if not self.engine.has_work:
                    self._hand_out([], force_stats=True)  # idle now: the gauges as they rest
                idle_since = None
        self._stop()

    def handle(self, message: ToCore) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequest):
            self.engine.abort(message.request_id)
        elif isinstance(message, Call):
            self._answer(message)
        elif isinstance(message, AbortAll):
            self.engine.abort_all()
        else:
            assert isinstance(message, Shutdown), message
            self.stopping = True

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add(message)
        except ValueError as err:  # the frontend checked it: a refusal here is a frontend's bug, told, not raised
            self._send(Outputs([refused(message.request_id, str(err), self.engine.clock())]))

    def _answer(self, call: Call) -> None:
        if isinstance(call, Embed):
            self._embedder.submit(self._embed, call)
            return
        try:
            if isinstance(call, ReadSlots):
                answer = CallDone(call.call_id, slots=list(self.engine.slot_states()))
            elif isinstance(call, ReadRoutingReport):
                answer = CallDone(call.call_id, report=self.routing_report(call.block_tokens, call.max_blocks))
            elif isinstance(call, LoadAdapter):
                answer = CallDone(call.call_id, index=self.engine.load_adapter(call.path))
            else:
                assert isinstance(call, UnloadAdapter), call
                self.engine.unload_adapter(call.index)
                answer = CallDone(call.call_id)
        except Exception as err:  # the caller's to report (a bad adapter file is a 400)
            answer = CallDone(call.call_id, error_kind=type(err).__name__, error=str(err))
        self._send(answer)

    def routing_report(self, block_tokens: int, max_blocks: int) -> RoutingReport:
        """What the engine holds and how busy it is, now (between two ticks); ValueError for a shape below 1."""
        engine = self.engine
        hashes = self.digest_builder(block_tokens, max_blocks).digest(engine.held_prefixes())
        return RoutingReport(hashes, engine.kv_use(), engine.waiting_tokens(), engine.n_queued, engine.n_running)

    def digest_builder(self, block_tokens: int, max_blocks: int) -> DigestBuilder:
        """The digest that reports of this shape go on from (with the hashes of the arrays their last one saw)."""
        shape = (block_tokens, max_blocks)
        builder = self._digests.pop(shape, None) or DigestBuilder(block_tokens, max_blocks)
        self._digests[shape] = builder  # the most recently asked last
        if len(self._digests) > MAX_DIGESTS:
            del self._digests[next(iter(self._digests))]
        return builder

    def _embed(self, call: Embed) -> None:
        try:
            rows = np.ascontiguousarray(self.engine.embed(call.inputs), dtype=np.float32)
            answer = CallDone(call.call_id, vectors=rows.tobytes(), n_rows=len(rows))
        except Exception as err:
            answer = CallDone(call.call_id, error_kind=type(err).__name__, error=str(err))
        self._send(answer)

    def _tick_done(self, record: TickRecord) -> None:
        summary = TickSummary.of(record)
        with self._lock:
            self._ticks.append(summary)

    def _hand_out(self, outputs: list[RequestOutput], force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self._stats_sent_at >= STATS_EVERY_S or any(o.finished for o in outputs):
            stats, self._stats_sent_at = self.engine.stats(), now
        with self._lock:
            ticks, self._ticks = self._ticks, []
        if outputs or ticks or stats is not None:
            self._send(Outputs(outputs, ticks, stats))

    def _stop(self) -> None:
        """Every request still live ends (its client gets its final output), then the embeddings thread."""
        self.engine.abort_all()
        while self.engine.has_work:
            self.engine.step()
        self._hand_out([], force_stats=True)
        self._embedder.shutdown(wait=True)


def settle_heap() -> None:
    """Once the model and the app are loaded: what exists now lives as long as the server, so it is frozen out
    of the collector's scans, and a tick's thousands of short-lived objects start a pass every 50,000
    allocations instead of 700. With hundreds of streams the decode thread then waits less for the GIL, and the
    backend is busy a larger share of the time (bench/engine/sleeping_backend.py; docs/results.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
