"""Scheduler.schedule() driven directly, with no backend at all: plans, KV operations included, are pure data."""

from __future__ import annotations

from cobali.backends.base import BackendInfo
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.plan import ClearSlot, CopyPrefix, Plan, TrimSlot
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.scheduler import Scheduler


def make_scheduler(slots: int = 4, n_batch: int = 64, chunk: int = 64, prefix_cache: bool = True,
                   unified_cells: int | None = None, **kwargs) -> Scheduler:
    cells = unified_cells or 256
    info = BackendInfo(n_vocab=96, n_ctx=cells if unified_cells else cells * slots, n_ctx_seq=cells,
                       n_seq_max=slots, n_batch=n_batch, kv_unified=unified_cells is not None, description="none")
    config = EngineConfig(max_slots=slots, n_batch=n_batch, prefill_chunk_tokens=chunk, **kwargs)
    return Scheduler(config, SlotPool(info, slots, prefix_cache=prefix_cache))


def request(request_id: int, tokens: list[int], max_tokens: int = 1000) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def executed(scheduler: Scheduler, plan: Plan) -> Plan:
    """The engine's part, without a model: each sampling chunk's token takes its stand-in (the plan counted the
    chunks' tokens into KV as it was made)."""
    by_id = {r.id: r for r in scheduler.running}
    for chunk in plan.chunks:
        if chunk.yields_token:
            by_id[chunk.request_id].add_token(7)
    return plan


def shape(plan: Plan) -> list[tuple[int, str, int, int]]:
    return [(c.request_id, c.kind.value, c.start, c.n_tokens) for c in plan.chunks]


SYSTEM = list(range(1, 33))  # a 32-token shared prefix: two blocks


def test_new_slots_are_cleared_before_the_batch() -> None:
    scheduler = make_scheduler()
    scheduler.add(request(0, [5] * 10))
    scheduler.add(request(1, [6] * 20))
    plan = scheduler.schedule()
    assert shape(plan) == [(0, "prefill", 0, 10), (1, "prefill", 0, 20)]
    assert plan.kv_ops == (ClearSlot(0), ClearSlot(1))
    assert plan.admitted == (0, 1)
    assert [c.yields_token for c in plan.chunks] == [True, True]


def test_a_cached_prefix_is_trimmed_in_place_and_only_the_suffix_prefilled() -> None:
    scheduler = make_scheduler()
    first = request(0, [*SYSTEM, 50, 51])
    scheduler.add(first)
    executed(scheduler, scheduler.schedule())
    scheduler.remove(first, keep_kv=True)  # finished: its KV stays as a cached prefix, nothing to run
    scheduler.add(request(1, [*SYSTEM, 60, 61, 62]))
    plan = scheduler.schedule()
    assert plan.kv_ops == (TrimSlot(0, 32),), "the slot keeps the shared 32 tokens and drops the rest"
    assert shape(plan) == [(1, "prefill", 32, 3)]


def test_a_running_request_lends_its_prefix_by_copy() -> None:
    scheduler = make_scheduler()
    scheduler.add(request(0, [*SYSTEM, 50]))
    executed(scheduler, scheduler.schedule())
    scheduler.add(request(1, [*SYSTEM, 60, 61]))
    plan = scheduler.schedule()
    assert plan.kv_ops == (ClearSlot(1), CopyPrefix(source=0, slot=1, n_tokens=32))
    assert shape(plan) == [(0, "decode", 33, 1), (1, "prefill", 32, 2)]


def test_a_released_slot_is_cleared_in_the_next_plan() -> None:
    scheduler = make_scheduler(prefix_cache=False)
    first = request(0, [5] * 10)
    scheduler.add(first)
    executed(scheduler, scheduler.schedule())
    scheduler.remove(first)
    scheduler.add(request(1, [6] * 10))
    plan = scheduler.schedule()
    assert plan.kv_ops == (ClearSlot(0), ClearSlot(0)), "released, then handed out again: both clear"
    assert shape(plan) == [(1, "prefill", 0, 10)]


def test_a_cached_prefix_is_dropped_when_the_pool_needs_its_cells() -> None:
    scheduler = make_scheduler(slots=3, unified_cells=96)  # 6 blocks
    for request_id, token in ((0, 3), (1, 4)):
        done = request(request_id, [token] * 30, max_tokens=1)
        scheduler.add(done)
        executed(scheduler, scheduler.schedule())
        scheduler.remove(done, keep_kv=True)  # each leaves a 2-block prefix behind
    scheduler.add(request(2, [9] * 60, max_tokens=1))  # needs 4 blocks: one prefix must go
    plan = scheduler.schedule()
    assert plan.kv_ops == (ClearSlot(0), ClearSlot(0)), "the least recently released prefix goes first"
    assert shape(plan) == [(2, "prefill", 0, 60)]
    assert scheduler.slots.cached_blocks == 2


def test_a_capped_decode_set_rotates_so_nobody_starves() -> None:
    scheduler = make_scheduler(slots=8, n_batch=8, chunk=8, policy="balanced")
    for request_id in range(7):
        scheduler.add(request(request_id, [request_id + 1]))
    executed(scheduler, scheduler.schedule())  # seven one-token prompts: all decoding from now on
    scheduler.add(request(7, [9] * 100))  # a long prompt keeps prefill work waiting
    executed(scheduler, scheduler.schedule())
    decoded = []
    for _ in range(7):
        plan = executed(scheduler, scheduler.schedule())
        # Balanced keeps half the 8-token budget for the prompt: 4 of the 7 decodes run each tick.
        assert plan.n_decode == 4 and plan.n_prefill_tokens == 4
        decoded.append([c.request_id for c in plan.chunks if c.kind.value == "decode"])
    start = scheduler.tick - 6
    assert decoded[0] == [(start + i) % 7 for i in range(4)], "the set starts where the tick number points"
    assert decoded[1] == [(start + 1 + i) % 7 for i in range(4)]
    assert {r for d in decoded for r in d} == set(range(7)), "every generating request decodes within 7 ticks"
