"""Async scheduling: plan and fill tick t+1 while tick t's decode runs, so a fast device waits for no host work.

The engine's thread runs the decodes back to back; llama_decode releases the GIL, so while one runs a host
thread does the rest with the engine's own three calls: it applies the last decode's result
(update_from_output: tokens placed, streamed, requests finished), then plans the next tick (schedule) and
fills its batch. The plan counts the token the running decode samples as a stand-in (PENDING_TOKEN), as
every plan does, so it already gives the request a decode row; when the decode returns, the engine's thread
samples, writes the tokens into those rows and launches the next batch at once. No thread has to wake up
between two decodes. The price: a request that hits a stop string or an end-of-generation token rides one
extra row, whose token is dropped. A request that reaches max_tokens or its context is known in advance and
gets no such row.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cobali.backends.base import BatchArrays, DecodeError
from cobali.engine.executor import Executor, Prepared, StepResult
from cobali.engine.outputs import RequestOutput
from cobali.engine.plan import MoveSlot, Plan
from cobali.engine.request import PENDING_TOKEN

SWITCH_INTERVAL_S = 0.0001


class Phases(Protocol):
    """The engine's tick as three calls (cobali.engine.engine.Engine), which the pipeline spreads over two
    threads."""

    _executor: Executor
    clock: Callable[[], float]
    n_cut: int  # requests that ended with a decode in flight sampling their next token

    def schedule(self) -> Plan: ...

    def update_from_output(self, plan: Plan, result: StepResult, later: Plan | None = None
                           ) -> list[RequestOutput]: ...

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]: ...


@dataclass
class Staged:
    """A planned tick, its batch filled in one of the two buffers."""

    prepared: Prepared
    cuts_before: int  # the engine's n_cut when the batch was filled
    # Found while the decode before it runs, so that decode's return waits for less: the rows whose token it
    # samples (PENDING_TOKEN stand-ins), their slots, and each one's place among its samplers (None when the
    # plan preempted a request or moved one: it may sit in another slot now).
    feed_rows: np.ndarray
    feed_slots: np.ndarray
    feed_src: np.ndarray | None

    @property
    def plan(self) -> Plan:
        return self.prepared.plan


class Pipeline:
    """Drives an engine's ticks: the decodes on the calling thread, everything else beside them on a host
    thread. Each step decodes one batch and returns the outputs made meanwhile (none when the engine's sink
    takes them); the host thread is idle between steps, so outputs never change while the caller looks."""

    def __init__(self, engine: Phases) -> None:
        self.engine = engine
        info = engine._executor.backend.info
        # Two buffers: the next batch is filled while the decode reads the other.
        self._buffers = [BatchArrays.zeros(info.n_batch), BatchArrays.zeros(info.n_batch)]
        self._fills = 0
        # One more entry than slots: the last one takes the tokens of requests that lost their slot.
        self._token_of_slot = np.full(info.n_seq_max + 1, PENDING_TOKEN, dtype=np.int32)
        self._row_of_slot = np.empty(info.n_seq_max, dtype=np.intp)  # _stage's scratch (host thread)
        self._host = ThreadPoolExecutor(1, thread_name_prefix="cobali-host")
        self._ready: Staged | None = None  # planned and filled: the next decode
        self._unsettled: tuple[Plan, StepResult] | None = None  # decoded and sampled, not yet applied
        # A returning decode needs the GIL back from the host thread and the server's event loop, which by default
        # keep it for as long as a GPU's decode step takes (docs/results.md: "The switch interval, again").
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))

    @property
    def in_flight(self) -> bool:
        return self._ready is not None or self._unsettled is not None

    def step(self) -> list[RequestOutput]:
        engine, executor = self.engine, self.engine._executor
        made: list[RequestOutput] = []
        if self._ready is None:  # the first tick, or the pipeline ran dry: catch up here
            made = self._settle()
            plan = engine.schedule()
            if plan.is_empty:
                return made + engine.deliver(engine.update_from_output(plan, executor.execute(plan)))
            self._ready = self._stage(plan)
        staged, self._ready = self._ready, None
        host_work = self._host.submit(self._settle_and_plan, staged)
        launched = engine.clock()
        try:
            logits, _ = executor.decode(staged.prepared)
        except DecodeError as err:
            upcoming, idle, made_there = host_work.result()
            later = upcoming.plan if upcoming is not None else idle
            assert later is not None
            return made + made_there + self._recover(staged, later, err, launched)
        decoded = engine.clock()
        upcoming, idle, made_there = host_work.result()
        if idle is not None:  # a next plan with no batch: its KV operations wait for no decode
            executor.run_kv_ops(idle.kv_ops)
        result = executor.sample(staged.prepared, logits, launched, decoded, engine.n_cut != staged.cuts_before)
        if upcoming is not None:
            self._feed(upcoming, staged, result)
        self._ready, self._unsettled = upcoming, (staged.plan, result)
        return made + made_there

    def _settle_and_plan(self, staged: Staged) -> tuple[Staged | None, Plan | None, list[RequestOutput]]:
        """On the host thread, while `staged` decodes: the last decode's result applied, then the next tick
        planned and its batch filled (or its plan, if it has no batch), and the outputs not handed to a sink."""
        # Checked here, not before the launch, where it would cost the time between two decodes.
        assert (staged.prepared.arrays.tokens[: staged.prepared.filled.n_rows] >= 0).all(), \
            "a row feeds a token no decode sampled"
        made = self._settle()
        plan = self.engine.schedule()
        if plan.is_empty:
            return None, plan, made
        return self._stage(plan, staged), None, made

    def _settle(self) -> list[RequestOutput]:
        """With no other thread at it: apply the last decode's result."""
        last, self._unsettled = self._unsettled, None
        if last is None:
            return []
        return self.engine.deliver(self.engine.update_from_output(*last))

    def _stage(self, plan: Plan, decoding: Staged | None = None) -> Staged:
        """Fill the plan's batch, and find the rows that feed a token the `decoding` batch samples."""
        self._fills += 1  # alternate: the batch filled last may be the one decoding now
        arrays = self._buffers[self._fills % 2]
        prepared = self.engine._executor.prepare(plan, arrays)
        feed_rows = np.flatnonzero(arrays.tokens[: prepared.filled.n_rows] == PENDING_TOKEN)
        feed_slots = arrays.seq_ids[feed_rows]
        feed_src = None
        # A preemption or a slot move changes which slot a request's stand-in feeds from.
        moved = any(isinstance(op, MoveSlot) for op in plan.kv_ops)
        if decoding is not None and not plan.preempted and not moved:
            rows, row_of_slot = decoding.prepared.filled.sample_rows, self._row_of_slot
            row_of_slot.fill(-1)
            row_of_slot[decoding.prepared.arrays.seq_ids[rows]] = np.arange(len(rows))
            feed_src = row_of_slot[feed_slots]
            assert (feed_src >= 0).all(), "a stand-in for a token the running decode does not sample"
        return Staged(prepared, self.engine.n_cut, feed_rows, feed_slots, feed_src)

    def _feed(self, staged: Staged, decoded: Staged, result: StepResult) -> None:
        """Write the tokens just sampled (by `decoded`) over the stand-ins in the next batch's rows: a request
        has one row in it. A request whose sampler failed ends; its row gets any valid token and is dropped."""
        tokens = staged.prepared.arrays.tokens
        if result.requests is decoded.prepared.filled.samplers and not result.failures and staged.feed_src is not None:
            # Every sampler sampled: a stand-in's token is at its request's place among them. A request that
            # lost its slot meanwhile has no row to feed, and a new one in it feeds its prompt.
            tokens[staged.feed_rows] = np.asarray(result.tokens)[staged.feed_src]
            return
        by_slot = self._token_of_slot
        by_slot.fill(PENDING_TOKEN)
        sampled = [0 if t is None else int(t) for t in result.tokens]  # a failed sampler's row is dropped
        slots = [-1 if r.slot is None else r.slot for r in result.requests]  # -1: preempted meanwhile
        by_slot[slots] = sampled
        by_slot[-1] = PENDING_TOKEN
        tokens[staged.feed_rows] = by_slot[staged.feed_slots]

    def _recover(self, failed: Staged, later: Plan, err: DecodeError, launched: float) -> list[RequestOutput]:
        """The decode failed, and the next plan assumed it had not: that plan never runs. Its KV operations do;
        the engine sends every request of either plan back to the queue to recompute (llama.cpp left the KV as
        before the failed batch), failing the failed batch's for a failure that is not a full KV."""
        engine = self.engine
        engine._executor.run_kv_ops(later.kv_ops)
        now = engine.clock()
        result = StepResult((), (), decode_start=launched, decode_end=now, sampled_at=now, error=err)
        return engine.deliver(engine.update_from_output(failed.plan, result, later=later))
