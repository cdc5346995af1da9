"""Async scheduling: plan and fill tick t+1 while tick t's decode runs, so a fast device waits for no host work.

llama_decode releases the GIL, so a decode runs on a thread of its own while the engine thread plans the next
batch. At launch every request counts the token its row will sample as a stand-in (PENDING_TOKEN), so the
next plan can already give it a decode row; when the decode returns, the sampled tokens replace the stand-ins,
are written into the next batch's rows, and that batch launches at once. Streaming, stop checks and finishing
then run beside the new decode. The price: a request that hits a stop string or an end-of-generation token
rides one extra row, whose token is dropped. A request that reaches max_tokens or its context is known in
advance and gets no such row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cobali.backends.base import Backend, BatchArrays, DecodeError
from cobali.engine.batch_fill import Filled, fill_batch
from cobali.engine.plan import KvOp, Plan, TickRecord
from cobali.engine.request import PENDING_TOKEN, FinishReason, Request, Sampled
from cobali.engine.scheduler import Scheduler

SWITCH_INTERVAL_S = 0.0002


class TickHost(Protocol):
    """The parts of a tick the engine (cobali.engine.engine.Engine) does for the pipeline."""

    backend: Backend
    clock: Callable[[], float]
    requests: dict[int, Request]
    scheduler: Scheduler
    n_finished: int

    def take_submissions(self, now: float) -> None: ...
    def run_kv_ops(self, ops: tuple[KvOp, ...]) -> None: ...
    def fail_unrunnable_head(self, now: float) -> None: ...
    def advance(self, plan: Plan, filled: Filled, pending: bool = False) -> None: ...
    def sample(self, plan: Plan, filled: Filled, logits: np.ndarray, finishes_since: int | None = None
               ) -> Sampled: ...
    def place_tokens(self, sampled: Sampled) -> None: ...
    def accept(self, sampled: Sampled, now: float) -> None: ...
    def finish(self, request: Request, reason: FinishReason, now: float, error: str | None = None) -> None: ...
    def close_tick(self, record: TickRecord, seconds: float | None) -> None: ...


@dataclass
class Staged:
    """A planned tick, its batch filled in one of the two buffers, maybe launched."""

    plan: Plan
    arrays: BatchArrays
    filled: Filled
    finishes_before: int  # the engine's n_finished when the batch was filled
    start: float
    n_running: int
    n_waiting: int
    launched: float = 0.0
    decode: Future[np.ndarray] | None = None
    decoded: float = 0.0  # when the device thread's decode returned


class Pipeline:
    """Drives an Engine's ticks two at a time: one decoding on the device thread, the next being planned."""

    def __init__(self, engine: TickHost) -> None:
        self.engine = engine
        n_batch = engine.backend.info.n_batch
        # Two buffers: the next batch is filled while the device thread's decode reads the other.
        self._buffers = [BatchArrays.zeros(n_batch), BatchArrays.zeros(n_batch)]
        # One more entry than slots: the last one takes the tokens of requests that lost their slot.
        self._token_of_slot = np.full(engine.backend.info.n_seq_max + 1, PENDING_TOKEN, dtype=np.int32)
        self._device = ThreadPoolExecutor(1, thread_name_prefix="cobali-decode")
        self._in_flight: Staged | None = None
        # A decode that returns needs the GIL back from the engine thread, which by default keeps it up to
        # 5 ms: as long as a GPU's decode step. (Process-wide; measured: 256 sleeping 5 ms decodes went from
        # 6.4 to 5.5 ms each.)
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def step(self) -> TickRecord | None:
        if self._in_flight is None:
            first = self._plan()
            if first is None:
                return None
            self._launch(first)
            self.engine.advance(first.plan, first.filled, pending=True)
        current = self._in_flight
        assert current is not None and current.decode is not None
        upcoming = self._plan()
        try:
            logits = current.decode.result()
        except DecodeError as err:
            return self._recover(current, upcoming, err)
        decode_end = current.decoded
        sampled = self.engine.sample(current.plan, current.filled, logits, current.finishes_before)
        if upcoming is not None:
            self._feed_sampled(upcoming, sampled)
            self._launch(upcoming)
            seconds = upcoming.launched - current.launched
        else:
            self._in_flight = None
            seconds = self.engine.clock() - current.launched
        self.engine.place_tokens(sampled)
        if upcoming is not None:
            self.engine.advance(upcoming.plan, upcoming.filled, pending=True)
        self.engine.accept(sampled, self.engine.clock())
        return self._close(current, decode_end, seconds)

    def _plan(self) -> Staged | None:
        """The next tick, planned on what the engine will know once the decode in flight is sampled. None when
        nothing can run; its KV operations then run at once if no decode is in flight, else after it."""
        engine = self.engine
        start = engine.clock()
        engine.take_submissions(start)
        plan = engine.scheduler.schedule(start)
        if plan.is_empty:
            if self._in_flight is not None:
                wait([self._in_flight.decode])  # the device must be idle before KV changes under it
            engine.run_kv_ops(plan.kv_ops)
            if self._in_flight is None:
                engine.fail_unrunnable_head(start)
            return None
        arrays = self._buffers[plan.tick % 2]
        filled = fill_batch(arrays, plan.rows, engine.requests, start)
        queues = engine.scheduler
        return Staged(plan, arrays, filled, engine.n_finished, start, len(queues.running), len(queues.waiting))

    def _feed_sampled(self, staged: Staged, sampled: Sampled) -> None:
        """Write the tokens just sampled over the stand-ins in the next batch's rows (by slot: a request has
        one row in it). A request whose sampler failed ends; its row gets any valid token and is dropped."""
        by_slot = self._token_of_slot
        by_slot.fill(PENDING_TOKEN)
        tokens_sampled = [0 if t is None else t for t in sampled.tokens] if sampled.failures else sampled.tokens
        slots = [-1 if r.slot is None else r.slot for r in sampled.requests]  # -1: preempted meanwhile
        by_slot[slots] = tokens_sampled
        by_slot[-1] = PENDING_TOKEN
        n = staged.filled.n_rows
        tokens, seq_ids = staged.arrays.tokens[:n], staged.arrays.seq_ids[:n]
        rows = np.flatnonzero(tokens == PENDING_TOKEN)
        tokens[rows] = by_slot[seq_ids[rows]]
        assert (tokens >= 0).all(), "a row feeds a token no decode sampled"

    def _launch(self, staged: Staged) -> None:
        """Start the decode; the caller then counts its tokens (Engine.advance), once the last ones are placed."""
        staged.launched = self.engine.clock()
        staged.decode = self._device.submit(self._decode, staged)
        self._in_flight = staged

    def _decode(self, staged: Staged) -> np.ndarray:
        """On the device thread: the plan's KV operations, then its batch."""
        self.engine.run_kv_ops(staged.plan.kv_ops)
        b, n = staged.arrays, staged.filled.n_rows
        try:
            return self.engine.backend.decode(b.tokens[:n], b.positions[:n], b.seq_ids[:n], b.want_logits[:n])
        finally:
            staged.decoded = self.engine.clock()

    def _recover(self, failed: Staged, upcoming: Staged | None, err: DecodeError) -> TickRecord:
        """The decode in flight failed, and the next plan assumed it had not: that plan never runs. Its KV
        operations do; every request of either plan goes back to the queue to recompute (llama.cpp left
        the KV as before the failed batch). As without overlap, a failure that is not a full KV, or a
        lone request that cannot fit, fails the failed batch's requests."""
        engine = self.engine
        now = failed.decoded
        self._in_flight = None
        if upcoming is not None:
            engine.run_kv_ops(upcoming.plan.kv_ops)
        in_batch = list({r.id: r for r in failed.filled.requests if not r.is_finished}.values())
        for request in in_batch:
            request.drop_pending_tokens()
        if not (err.no_kv_slot and len(in_batch) > 1):
            for request in in_batch:
                engine.finish(request, FinishReason.ERROR, now, f"decode failed: {err}")
        chunks = failed.plan.chunks + (upcoming.plan.chunks if upcoming is not None else ())
        for request_id in dict.fromkeys(c.request_id for c in chunks):
            engine.scheduler.preempt_newest(f"decode failed: {err}", among={request_id})
        return self._close(failed, now, None)

    def _close(self, staged: Staged, decode_end: float, seconds: float | None) -> TickRecord:
        record = TickRecord(staged.plan, staged.start, staged.launched, decode_end, self.engine.clock(),
                            n_running=staged.n_running, n_waiting=staged.n_waiting)
        self.engine.close_tick(record, seconds)
        return record
