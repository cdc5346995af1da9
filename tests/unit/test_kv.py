"""KV as a managed resource: admission, preemption, prefix reuse, eviction, queue order, batch policies."""

from __future__ import annotations

import pytest

from cobali.backends.base import SamplingParams
from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.queue import ShortestPromptFirst, WaitQueue
from cobali.engine.request import FinishReason, Request, RequestState


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
    runs = engine.generate(PROMPTS, LONG)
    assert engine.scheduler.preemptions == 0
    assert all(r.finish_reason is FinishReason.LENGTH for r in runs)
    # 60 tokens each, 4 blocks each: only two fit in the 8-block pool at once.
    assert max(len({c.request_id for c in t.plan.chunks}) for t in engine.ticks) == 2


def test_optimistic_preempts_the_newest_and_its_output_is_unchanged() -> None:
    roomy = make_engine(prefix_cache=False).generate(PROMPTS, LONG)
    engine = make_engine(unified_cells=128, kv_admission="optimistic", prefix_cache=False)
    runs = engine.generate(PROMPTS, LONG)
    assert engine.scheduler.preemptions > 0
    first = next(t.plan for t in engine.ticks if t.plan.preempted)
    assert first.preempted == (3, 2), "newest first, until the older ones have room"
    assert first.admitted == (), "no admission in a tick that preempted"
    assert [r.output_tokens for r in runs] == [r.output_tokens for r in roomy]


def test_preempted_request_goes_to_the_front_of_the_queue() -> None:
    engine = make_engine(slots=2)
    engine.add_request(prompt(5, 1), LONG)
    victim = engine.add_request(prompt(5, 2), LONG)
    later = engine.add_request(prompt(5, 3), LONG)
    engine.step()
    engine.step()
    engine.scheduler.preempt_newest("test")
    assert victim.state is RequestState.PENDING and victim.computed_tokens == 0
    assert list(engine.scheduler.waiting) == [victim, later]
    assert len(victim.output_tokens) == 2, "tokens already streamed are kept"


def test_never_fitting_request_is_rejected_at_once() -> None:
    engine = make_engine(unified_cells=64)
    with pytest.raises(ValueError, match="context holds 64"):
        engine.add_request(prompt(64))


def test_prefix_hit_prefills_only_the_suffix() -> None:
    engine = make_engine(slots=2)
    system = prompt(48, 9)
    engine.generate([system + prompt(10, 1)], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.ticks.clear()
    engine.generate([system + prompt(10, 2)], SamplingParams(max_tokens=2, ignore_eos=True))
    assert shape(engine)[0] == [(1, "prefill", 48, 10)]
    assert engine.slots.hit_tokens == 48 and engine.slots.queried_tokens == 116


def test_prefix_is_copied_from_a_running_request() -> None:
    engine = make_engine(slots=2)
    system = prompt(48, 9)
    engine.add_request(system + prompt(10, 1), LONG)
    engine.step()
    engine.add_request(system + prompt(10, 2), LONG)
    engine.step()
    assert shape(engine)[1] == [(0, "decode", 58, 1), (1, "prefill", 48, 10)]
    assert engine.backend.kv[1][:48] == system


def test_prefix_reuse_keeps_outputs_equal() -> None:
    system = prompt(40, 9)
    prompts = [system + prompt(6, s) for s in range(6)]
    cached = make_engine(slots=3).generate(prompts, LONG)
    plain = make_engine(slots=3, prefix_cache=False).generate(prompts, LONG)
    assert [r.output_tokens for r in cached] == [r.output_tokens for r in plain]


def test_lru_cached_prefix_is_evicted_first() -> None:
    engine = make_engine(slots=3, unified_cells=96)  # 6 blocks
    a, b = prompt(30, 1), prompt(30, 2)
    engine.generate([a], SamplingParams(max_tokens=1))
    engine.generate([b], SamplingParams(max_tokens=1))
    assert engine.slots.cached_blocks == 4 and engine.backend.kv[0] == a and engine.backend.kv[1] == b
    c = prompt(60, 3)
    engine.add_request(c, SamplingParams(max_tokens=1))  # needs 4 blocks: one prefix must go
    engine.step()
    assert engine.backend.kv[0] == c, "a's prefix was released first: it is evicted, and c takes the lowest slot"
    assert engine.backend.kv[1] == b
    assert engine.backend.kv[2] == []


def test_with_per_sequence_streams_a_new_request_takes_the_lowest_slot_over_a_cached_prefix() -> None:
    """llama.cpp's attention spans the streams between a batch's lowest and highest seq_id: running requests
    must stay in the lowest slots, even at the cost of a cached prefix (bench/kv_streams.py)."""
    engine = make_engine(slots=3)
    a, b = prompt(30, 1), prompt(30, 2)
    engine.generate([a, b], SamplingParams(max_tokens=1))
    assert (engine.backend.kv[0], engine.backend.kv[1], engine.backend.kv[2]) == (a, b, [])  # both prefixes kept
    c = engine.add_request(prompt(30, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert c.slot == 0, "slot 2 is empty, but slot 0 keeps the running seq_ids lowest"
    hits = engine.slots.hit_tokens
    engine.generate([b], SamplingParams(max_tokens=1))
    assert engine.slots.hit_tokens - hits == 29, "b's prefix, in slot 1, is still reused"


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
        engine.run_until_done()
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
    engine.run_until_done()
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
