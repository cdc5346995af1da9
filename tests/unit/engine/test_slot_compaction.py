"""Slot compaction: with per-sequence KV streams, the running requests are kept in the lowest slots, as
llama.cpp runs one forward pass per run of consecutive seq_ids among a batch's rows."""

from __future__ import annotations

import pytest

from cobali.backends.base import BackendInfo
from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.plan import ClearSlot, MoveSlot
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.scheduler import Scheduler
from cobali.frontend.offline import LLM


def make_scheduler(slots: int = 4, unified: bool = False) -> Scheduler:
    info = BackendInfo(n_vocab=96, n_ctx=256 * slots, n_ctx_seq=256, n_seq_max=slots, n_batch=64,
                       kv_unified=unified, description="none")
    config = EngineConfig(max_slots=slots, n_batch=64, prefill_chunk_tokens=64)
    return Scheduler(config, SlotPool(info, slots, compact=True))


def decoding(scheduler: Scheduler, n: int) -> list[Request]:
    """n requests decoding in slots 0..n-1."""
    requests = [Request(i, [5] * 8, SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(n)]
    for r in requests:
        scheduler.add(r)
    for chunk in scheduler.schedule().chunks:  # planned as run: each has a stand-in for its first token
        requests[chunk.request_id].add_token(7)
    return requests


def test_the_request_in_the_highest_slot_moves_into_a_gap_below_it() -> None:
    scheduler = make_scheduler()
    requests = decoding(scheduler, 3)
    scheduler.remove(requests[1])  # finished: slot 1 is a gap between slots 0 and 2
    plan = scheduler.schedule()
    assert plan.kv_ops == (ClearSlot(1), ClearSlot(1), MoveSlot(source=2, slot=1))
    assert requests[2].slot == 1
    assert [(c.request_id, c.slot) for c in plan.rows] == [(0, 0), (2, 1)]
    assert scheduler.schedule().kv_ops == (), "one run of slots: nothing more to move"


def test_a_free_slot_below_every_running_one_is_no_gap() -> None:
    scheduler = make_scheduler()
    requests = decoding(scheduler, 3)
    scheduler.remove(requests[0])
    assert scheduler.schedule().kv_ops == (ClearSlot(0),), "slots 1 and 2 are one run: nothing moves"


def test_an_admission_fills_the_hole_and_nothing_moves() -> None:
    scheduler = make_scheduler()
    requests = decoding(scheduler, 3)
    scheduler.remove(requests[1])
    scheduler.add(Request(9, [6] * 4, SamplingParams(max_tokens=4)))
    plan = scheduler.schedule()
    assert not any(isinstance(op, MoveSlot) for op in plan.kv_ops)
    assert sorted(c.slot for c in plan.chunks) == [0, 1, 2]


def test_a_unified_kv_never_moves_a_request() -> None:
    scheduler = make_scheduler(unified=True)
    requests = decoding(scheduler, 3)
    scheduler.remove(requests[1])
    assert not any(isinstance(op, MoveSlot) for op in scheduler.schedule().kv_ops)


@pytest.mark.parametrize("compact", [True, False])
def test_a_new_request_takes_a_slot_beside_the_running_ones(compact: bool) -> None:
    info = BackendInfo(n_vocab=96, n_ctx=256 * 8, n_ctx_seq=256, n_seq_max=8, n_batch=64, kv_unified=False,
                       description="none")
    pool = SlotPool(info, 8, compact=compact)
    slots = [pool.assign().slot for _ in range(5)]
    assert slots == [0, 1, 2, 3, 4]
    for slot in (0, 1, 3):
        pool.release(slot)
    # Running: 2 and 4. Compacting, the gap at 3 first, then the slot below the run; else the lowest free.
    assert [pool.assign().slot for _ in range(2)] == ([3, 1] if compact else [0, 1])


def staggered(engine: Engine) -> list[Request]:
    """Six requests in slots 0-5, those in slots 1, 3 and 2 finishing first: each leaves a gap."""
    requests = [engine.add_request([3 + i] * (5 + i), SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate([20, 4, 12, 7, 16, 18])]
    list(LLM(engine).run())
    return requests


@pytest.mark.parametrize("overlap", [False, True])
def test_compaction_keeps_the_batches_in_one_run_of_slots_and_outputs_unchanged(overlap: bool) -> None:
    def run(compact: bool) -> tuple[list, list[int], int]:
        backend = FakeBackend(n_seq_max=8, n_batch=64)
        # No prefix cache: every move is a request's (a prefix cached in a gap would move out of it too).
        config = EngineConfig(max_slots=8, n_batch=64, compact_slots=compact, async_scheduling=overlap,
                              prefix_cache=False)
        engine = Engine(backend, config)
        requests = staggered(engine)
        moves = sum(isinstance(op, MoveSlot) for t in engine.ticks for op in t.plan.kv_ops)
        return [r.output_tokens for r in requests], [t.plan.slot_runs for t in engine.ticks], moves

    outputs, passes, moves = run(compact=True)
    plain_outputs, plain_passes, _ = run(compact=False)
    assert outputs == plain_outputs, "a moved request continues from its own KV"
    assert moves == 3, "the requests in slots 5, 4 and 4 (moved to 3) fill the gaps at 1, 3 and 2"
    # With async scheduling the next plan is made before a finishing request's slot is free: one batch a gap.
    assert sum(p > 1 for p in passes) == (moves if overlap else 0)
    assert sum(p > 1 for p in plain_passes) > 10, "without compaction the finished requests leave gaps"
