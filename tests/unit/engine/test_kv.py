"""KV as a managed resource: admission, preemption, prefix reuse, eviction, queue order, batch policies."""

from __future__ import annotations

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import ClearSlot, LoadSlot
from cobali.engine.queue import ShortestPromptFirst, WaitQueue
from cobali.engine.request import FinishReason, Request, RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM


def make_engine(slots: int = 4, unified_cells: int | None = None, n_batch: int = 128, chunk: int = 64,
                **config) -> Engine:
    if unified_cells is None:
        backend = FakeBackend(n_seq_max=slots, n_batch=n_batch)
    else:
        backend = FakeBackend(n_seq_max=slots, n_batch=n_batch, kv_unified=True, n_ctx_seq=unified_cells)
    return Engine(backend, EngineConfig(max_slots=slots, n_batch=n_batch, prefill_chunk_tokens=chunk, **config))


def prompt(n: int, seed: int = 1) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 90 for i in range(n)]


def shape(engine: Engine) -> list[list[tuple[int, str, int, int]]]:
    return [[(c.request_id, c.kind.value, c.start, c.n_tokens) for c in t.plan.chunks] for t in engine.ticks]


LONG = SamplingParams(max_tokens=40, ignore_eos=True)
PROMPTS = [prompt(20, s) for s in range(4)]


def test_reserve_never_preempts_on_a_tight_pool() -> None:
    engine = make_engine(unified_cells=128, kv_admission="reserve", prefix_cache=False)
    runs = LLM(engine).generate(PROMPTS, LONG)
    assert engine._scheduler.preemptions == 0
    assert all(r.finish_reason is FinishReason.LENGTH for r in runs)
    # 60 tokens each, 4 blocks each: only two fit in the 8-block pool at once.
    assert max(len({c.request_id for c in t.plan.chunks}) for t in engine.ticks) == 2


def test_optimistic_preempts_the_newest_and_its_output_is_unchanged() -> None:
    roomy = LLM(make_engine(prefix_cache=False)).generate(PROMPTS, LONG)
    engine = make_engine(unified_cells=128, kv_admission="optimistic", prefix_cache=False)
    runs = LLM(engine).generate(PROMPTS, LONG)
    assert engine._scheduler.preemptions > 0
    first = next(t.plan for t in engine.ticks if t.plan.preempted)
    assert first.preempted == (3, 2), "newest first, until the older ones have room"
    assert first.admitted == (), "no admission in a tick that preempted"
    assert [r.token_ids for r in runs] == [r.token_ids for r in roomy]


def test_cached_tokens_count_prompt_tokens_only() -> None:
    """Identical greedy requests on a tight pool: a preempted one comes back and reuses a twin's KV, output
    included; what it reports as cached is at most its prompt."""
    engine = make_engine(unified_cells=192, kv_admission="optimistic", prefix_cache=True)
    runs = LLM(engine).generate([prompt(20, 1)] * 4, LONG)
    assert engine._scheduler.preemptions > 0
    assert max(r.cached_tokens for r in runs) == 20, "one came back to a twin holding all of its prompt and more"


def test_preempted_request_goes_to_the_front_of_the_queue() -> None:
    engine = make_engine(slots=2)
    engine.add_request(prompt(5, 1), LONG)
    victim = engine.add_request(prompt(5, 2), LONG)
    later = engine.add_request(prompt(5, 3), LONG)
    engine.step()
    engine.step()
    engine._scheduler.preempt_newest("test")
    assert victim.state is RequestState.PENDING and victim.computed_tokens == 0
    assert list(engine._scheduler.waiting) == [victim, later]
    assert len(victim.output_tokens) == 2, "tokens already streamed are kept"


def test_never_fitting_request_is_rejected_at_once() -> None:
    engine = make_engine(unified_cells=64)
    with pytest.raises(ValueError, match="context holds 64"):
        engine.add_request(prompt(64))


def test_prefix_hit_prefills_only_the_suffix() -> None:
    engine = make_engine(slots=2)
    system = prompt(48, 9)
    LLM(engine).generate([system + prompt(10, 1)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.ticks.clear()
    LLM(engine).generate([system + prompt(10, 2)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert shape(engine)[0] == [(1, "prefill", 48, 10)]
    assert engine._slots.hit_tokens == 48 and engine._slots.queried_tokens == 116


def test_prefix_is_copied_from_a_running_request() -> None:
    engine = make_engine(slots=2)
    system = prompt(48, 9)
    engine.add_request(system + prompt(10, 1), LONG)
    engine.step()
    engine.add_request(system + prompt(10, 2), LONG)
    engine.step()
    assert shape(engine)[1] == [(0, "decode", 58, 1), (1, "prefill", 48, 10)]
    assert engine._backend.kv[1][:48] == system


def test_prefix_reuse_keeps_outputs_equal() -> None:
    system = prompt(40, 9)
    prompts = [system + prompt(6, s) for s in range(6)]
    cached = LLM(make_engine(slots=3)).generate(prompts, LONG)
    plain = LLM(make_engine(slots=3, prefix_cache=False)).generate(prompts, LONG)
    assert [r.token_ids for r in cached] == [r.token_ids for r in plain]


def test_lru_cached_prefix_is_evicted_first() -> None:
    engine = make_engine(slots=3, unified_cells=96)  # 6 blocks
    a, b = prompt(30, 1), prompt(30, 2)
    LLM(engine).generate([a], SamplingParams(max_tokens=1))
    LLM(engine).generate([b], SamplingParams(max_tokens=1))
    assert engine._slots.cached_blocks == 4 and engine._backend.kv[0] == a and engine._backend.kv[1] == b
    c = prompt(60, 3)
    engine.add_request(c, SamplingParams(max_tokens=1))  # needs 4 blocks: one prefix must go
    engine.step()
    assert engine._backend.kv[0] == c, "a's prefix was released first: it is evicted, and c takes the lowest slot"
    assert engine._backend.kv[1] == b
    assert engine._backend.kv[2] == []


@pytest.mark.parametrize("host_cache_mib", [0, 8192])
def test_a_full_unified_pool_spares_the_cached_prefix_the_new_request_reuses(host_cache_mib: int) -> None:
    """Making room evicts other cached prefixes, never the one the request reuses in place: that would cost a
    full prefill (or, with a host tier, a save and a load back)."""
    engine = make_engine(slots=2, unified_cells=128, host_cache_mib=host_cache_mib)  # 8 blocks
    system = prompt(48, 9)
    LLM(engine).generate([system + prompt(10, 1)], SamplingParams(max_tokens=1, ignore_eos=True))
    assert engine._slots.cached_blocks == 4
    engine.add_request(prompt(20, 2), LONG)  # 60 tokens reserved: 4 blocks, the pool is full
    engine.step()
    assert engine._slots.accountant.free_blocks == 0
    request = engine.add_request(system + prompt(10, 2), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    assert request.cached_tokens == 48
    assert shape(engine)[-1] == [(1, "decode", 20, 1), (2, "prefill", 48, 10)]
    assert not any(isinstance(op, (ClearSlot, LoadSlot)) for op in engine.ticks[-1].plan.kv_ops)


def test_a_spared_prefix_a_running_request_outdoes_is_evicted_after_all() -> None:
    engine = make_engine(slots=3, unified_cells=128)  # 8 blocks
    system = prompt(48, 9)
    engine.add_request(system + prompt(4, 2), SamplingParams(max_tokens=12, ignore_eos=True))  # 4 blocks
    engine.step()
    short = engine.add_request(system[:32] + prompt(10, 1), SamplingParams(max_tokens=1, ignore_eos=True))
    while short.finish_reason is None:
        engine.step()
    assert engine._slots.cached_blocks == 3 and engine._slots.accountant.free_blocks == 1
    request = engine.add_request(system + prompt(10, 3), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    assert request.cached_tokens == 48, "copied from the running request, not the cached 32 tokens"
    assert ClearSlot(1) in engine.ticks[-1].plan.kv_ops, "the spared prefix gives its cells to the copy"


def test_at_idle_each_prompt_keeps_its_kv_until_every_slot_holds_one() -> None:
    """A chat's next turn, or a prompt sent again, finds its KV as long as fewer than max_slots other prompts
    came between: a new request takes a slot holding no cached prefix, else the least recently released.
    (Without the host-memory tier, which would restore the prefixes evicted: tests/unit/engine/test_host_kv.py.)"""
    engine = make_engine(slots=4, host_cache_mib=0)
    prompts = [prompt(30, s) for s in range(6)]

    def send(p: list[int]) -> int:
        hits = engine._slots.hit_tokens
        LLM(engine).generate([p], SamplingParams(max_tokens=1))
        return engine._slots.hit_tokens - hits

    assert [send(p) for p in prompts[:4]] == [0] * 4
    assert [engine._backend.kv[s][:30] for s in range(4)] == prompts[:4]
    assert send(prompts[4]) == 0 and engine._backend.kv[0][:30] == prompts[4], "every slot holds one: the oldest goes"
    assert send(prompts[1]) == 29, "all but the last prompt token reused"
    assert send(prompts[5]) == 0 and engine._backend.kv[2][:30] == prompts[5], "slot 1 was used again: slot 2 goes"
    assert [send(p) for p in (prompts[1], prompts[3], prompts[4], prompts[5])] == [29] * 4
    assert send(prompts[2]) == 0


def test_with_per_sequence_streams_a_new_request_keeps_the_running_slots_one_run_and_spares_cached_kv() -> None:
    """llama.cpp runs one forward pass per run of consecutive seq_ids (bench/engine/kv_streams.py): a new request takes
    a slot beside the running ones, of those one holding no cached prefix; where each holds one, that prefix
    moves to the least recently released one's slot."""
    engine = make_engine(slots=5)
    a, b = prompt(30, 1), prompt(30, 2)
    LLM(engine).generate([a], SamplingParams(max_tokens=1))
    LLM(engine).generate([b], SamplingParams(max_tokens=1))
    c = engine.add_request(prompt(30, 3), LONG)
    engine.step()
    d = engine.add_request(prompt(30, 4), LONG)
    engine.step()
    assert (c.slot, d.slot) == (2, 3), "slots 0 and 1 hold a's and b's KV: c and d take the empty ones"
    e = engine.add_request(prompt(30, 5), LONG)
    f = engine.add_request(prompt(30, 6), LONG)
    engine.step()
    assert {e.slot, f.slot} == {1, 4}, "beside the run: the empty slot 4, then slot 1"
    assert engine._backend.kv[0][:30] == b, "b's KV moved out of slot 1 into slot 0: a's, released first, went"
    hits = engine._slots.hit_tokens
    g = engine.add_request(b, LONG)
    engine.step()
    assert g.slot == 0 and engine._slots.hit_tokens - hits == 29


def test_a_moved_prefix_keeps_its_place_in_the_release_order() -> None:
    engine = make_engine(slots=5)
    a, b, g = prompt(30, 1), prompt(30, 2), prompt(30, 3)
    for p in (a, b, g, b):  # slots 0, 1, 2, then 1 again: b is the most recently released
        LLM(engine).generate([p], SamplingParams(max_tokens=1))
    for s in range(3):  # slots 3, 4, then 2: g's KV moves to slot 0 (a's, the oldest, goes)
        engine.add_request(prompt(30, 10 + s), LONG)
        engine.step()
    assert engine._backend.kv[0][:30] == g and engine._backend.kv[1][:30] == b
    engine.add_request(prompt(30, 20), LONG)  # slot 1: b's KV is newer than g's, so b's moves over g's
    engine.step()
    assert engine._backend.kv[0][:30] == b


def test_closing_a_gap_moves_the_prefix_cached_in_it_to_an_empty_slot() -> None:
    engine = make_engine(slots=6)
    x, y, z = (engine.add_request(prompt(30, s), SamplingParams(max_tokens=n, ignore_eos=True))
               for s, n in ((1, 40), (2, 3), (3, 40)))
    while not y.is_finished:
        engine.step()
    assert (x.slot, z.slot) == (0, 2) and engine._backend.kv[1][:30] == y.prompt_tokens
    engine.step()
    assert z.slot == 1, "z moved into the gap"
    assert engine._backend.kv[5][:30] == y.prompt_tokens, "y's KV moved to the highest empty slot, not dropped"
    hits = engine._slots.hit_tokens
    LLM(engine).generate([y.prompt_tokens], SamplingParams(max_tokens=1))
    assert engine._slots.hit_tokens - hits == 29


def test_a_cached_prefix_away_from_the_running_slots_is_copied_beside_them_and_kept() -> None:
    engine = make_engine(slots=4)
    a = prompt(30, 1)
    for p in (a, prompt(30, 2), prompt(30, 3)):
        LLM(engine).generate([p], SamplingParams(max_tokens=1))
    x = engine.add_request(prompt(30, 4), LONG)
    engine.step()
    assert x.slot == 3
    follow_up = engine.add_request(a + prompt(8, 5), LONG)
    hits = engine._slots.hit_tokens
    engine.step()
    assert follow_up.slot == 2, "beside the running slot 3, not in slot 0 (a gap of two)"
    assert engine._slots.hit_tokens - hits == 30
    assert engine._backend.kv[0][:30] == a, "the copy's source keeps a's KV for the next request that shares it"


def test_head_of_line_bypass_is_bounded() -> None:
    queue = WaitQueue(max_bypass=2)
    big, small = Request(0, [1] * 100, LONG), [Request(i, [1], LONG) for i in range(1, 5)]
    for r in (big, *small):
        queue.push(r)
    fits = lambda r: len(r.prompt_tokens) < 50  # noqa: E731
    assert queue.pop_admissible(fits) is small[0]
    assert queue.pop_admissible(fits) is small[1]
    assert queue.pop_admissible(fits) is None, "the head was bypassed twice: now it waits"
    assert queue.pop_admissible(lambda r: True) is big


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    queue = WaitQueue("priority")
    reqs = [Request(i, [1], LONG, priority=p) for i, p in enumerate([5, 1, 5, 0])]
    for r in reqs:
        queue.push(r)
    assert [r.id for r in queue] == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="queue order"):
        WaitQueue("lifo")


def test_shortest_prompt_first_ages_so_a_long_prompt_waits_a_bounded_time() -> None:
    queue = WaitQueue("srpf", shortest_first=ShortestPromptFirst(s_per_token=0.001))
    # (id, prompt tokens, arrival s): ranks 1.0, 0.11, 0.7, and 1.51 for a short prompt arriving after
    # the long one has waited longer than its length's worth (1 s).
    for i, n, t in ((0, 1000, 0.0), (1, 10, 0.1), (2, 500, 0.2), (3, 10, 1.5)):
        queue.push(Request(i, [1] * n, LONG, arrival_time=t))
    assert [r.id for r in queue] == [1, 2, 0, 3]
    preempted = Request(4, [1] * 2000, LONG, arrival_time=9.0)
    queue.push(preempted, front=True)
    assert queue[0] is preempted, "a preempted request still goes first, whatever its length"
    assert [r.id for r in WaitQueue("fifo").prefill_order(list(queue))] == [4, 1, 2, 0, 3]
    assert [r.id for r in queue.prefill_order(list(queue))] == [1, 2, 0, 3, 4]


def test_srpf_gives_short_prompts_their_first_token_before_a_long_one_and_changes_no_output() -> None:
    first_token_tick = {}
    outputs = {}
    for order in ("fifo", "srpf"):
        engine = make_engine(slots=4, n_batch=64, chunk=64, queue=order, prefix_cache=False)
        requests = [engine.add_request(prompt(300, 1), SamplingParams(max_tokens=3, ignore_eos=True))]
        requests += [engine.add_request(prompt(20, s), SamplingParams(max_tokens=3, ignore_eos=True))
                     for s in (2, 3, 4)]
        list(LLM(engine).run())
        ticks = {t: i for i, t in enumerate(r.plan.tick for r in engine.ticks)}
        first_token_tick[order] = [ticks[_first_token_tick(engine, r)] for r in requests]
        outputs[order] = [r.output_tokens for r in requests]
    assert outputs["srpf"] == outputs["fifo"]
    assert max(first_token_tick["srpf"][1:]) < min(first_token_tick["fifo"][1:])
    assert first_token_tick["srpf"][0] > first_token_tick["fifo"][0], "the long prompt pays for it"


def _first_token_tick(engine: Engine, request: Request) -> int:
    return next(t.plan.tick for t in engine.ticks
                if any(c.request_id == request.id and c.yields_token for c in t.plan.chunks))


def _policy_run(policy: str) -> list[list[tuple[int, str, int, int]]]:
    engine = make_engine(slots=4, n_batch=8, chunk=8, policy=policy, prefix_cache=False)
    for s in range(3):
        engine.add_request(prompt(2, s), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.add_request(prompt(12, 7), SamplingParams(max_tokens=1, ignore_eos=True))
    list(LLM(engine).run())
    return shape(engine)


def test_decode_max_plan() -> None:
    assert _policy_run("decode-max")[:3] == [
        [(0, "prefill", 0, 2), (1, "prefill", 0, 2), (2, "prefill", 0, 2)],
        [(0, "decode", 2, 1), (1, "decode", 2, 1), (2, "decode", 2, 1), (3, "prefill", 0, 5)],
        [(0, "decode", 3, 1), (1, "decode", 3, 1), (2, "decode", 3, 1), (3, "prefill", 5, 5)],
    ]


def test_prefill_first_plan() -> None:
    assert _policy_run("prefill-first")[:4] == [
        [(0, "prefill", 0, 2), (1, "prefill", 0, 2), (2, "prefill", 0, 2)],
        [(3, "prefill", 0, 8)],
        [(3, "prefill", 8, 4)],
        [(0, "decode", 2, 1), (1, "decode", 2, 1), (2, "decode", 2, 1)],
    ]


def test_balanced_plan_reserves_half_the_budget_for_prefill() -> None:
    assert _policy_run("balanced")[:3] == [
        [(0, "prefill", 0, 2), (1, "prefill", 0, 2), (2, "prefill", 0, 2)],
        [(0, "decode", 2, 1), (1, "decode", 2, 1), (2, "decode", 2, 1), (3, "prefill", 0, 5)],
        [(0, "decode", 3, 1), (1, "decode", 3, 1), (2, "decode", 3, 1), (3, "prefill", 5, 5)],
    ]
