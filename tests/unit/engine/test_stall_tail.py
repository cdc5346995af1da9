"""StallTail: prompts go in whole while their stalls stay out of the ITL tail, in target-sized chunks otherwise."""

from __future__ import annotations

import numpy as np

from cobali.engine.budget import AdaptiveBudget, StallTail
from cobali.engine.costs import OnlineCostFit, TickTerms
from cobali.engine.engine_config import EngineConfig
from cobali.harness.workloads import arrival_offsets
from cobali.sim.cluster import SimItem, SimSpec, simulate
from tests.unit.engine.test_deadline_budget import PROFILE  # 10 ms a tick, 2 ms a prefill token, 5 ms a decode row


def decode_gaps(tail: StallTail, n: int, rows: int = 1) -> None:
    for _ in range(n):
        tail.observe(TickTerms(0, rows, 100 * rows))


def test_nothing_is_rare_before_a_hundred_gaps() -> None:
    tail = StallTail(512)
    decode_gaps(tail, 50)
    assert not tail.is_rare(1)  # one stall in 51 gaps would be 2 % of them
    decode_gaps(tail, 100)
    assert tail.is_rare(1)


def test_stalls_beyond_one_gap_in_a_hundred_end_whole_prompts() -> None:
    tail = StallTail(512, horizon_gaps=1e9)  # no fading: the counts are exact
    decode_gaps(tail, 1000, rows=4)  # 4000 gaps
    whole = 0
    while tail.is_rare(4):
        tail.observe(TickTerms(100, 4, 400, prompt_ends=(100,)))  # a prompt ends beside 4 decodes: 4 stalls
        whole += 1
    # Before the 10th, 36 + 4 stalled gaps of 4036 are still under 1 %; after it, 40 + 4 of 4040 would not be.
    assert whole == 10


def test_a_prompt_longer_than_the_batch_stalls_once_per_batch() -> None:
    tail = StallTail(512, horizon_gaps=1e9)
    tail.observe(TickTerms(64, 2, 200, prompt_ends=(1200,)))  # whole, it would take 3 ticks of 512
    assert tail.stalled == 2 * 3
    tail.observe(TickTerms(64, 0, 0, prompt_ends=(300,)))  # nobody decoding: nobody stalled
    assert (tail.stalled, tail.gaps, tail.share) == (6, 2, 3.0)


def test_old_stalls_fade() -> None:
    tail = StallTail(512, horizon_gaps=2000)
    decode_gaps(tail, 200)
    for _ in range(20):
        tail.observe(TickTerms(100, 2, 200, prompt_ends=(100,)))
    assert not tail.is_rare(2)
    decode_gaps(tail, 10_000)
    assert tail.is_rare(2)


def test_a_rare_stall_lets_the_prompt_in_whole() -> None:
    tail = StallTail(512)
    budget = AdaptiveBudget(OnlineCostFit(PROFILE), itl_target_s=0.100, n_batch=512, tail=tail)
    assert budget.prefill_tokens(2, 200) == 39  # (100 - 20.2 ms of decode) / 2 ms: the target while unsure
    decode_gaps(tail, 500, rows=2)
    assert budget.prefill_tokens(2, 200) == 510


def itl_p99_and_max(rate: float) -> tuple[float, float]:
    """60 prompts of 200-500 tokens (no shared prefix) and 100-300 output tokens at `rate` per second, on the
    virtual clock, under the adaptive budget with a 100 ms ITL target; every gap of every request pooled."""
    rng = np.random.default_rng(0)
    items = [SimItem(rng.integers(1, 96, int(rng.integers(200, 500))).tolist(), int(rng.integers(100, 300)))
             for _ in range(60)]
    spec = SimSpec(PROFILE, EngineConfig(max_slots=16, n_batch=512, itl_target_ms=100), 2048, prefill_tile=1)
    result = simulate(items, arrival_offsets(len(items), rate, 1.0, 1).tolist(), spec)
    itl = np.concatenate([f.timing.itl_ms for f in result.finished])
    return float(np.percentile(itl, 99)), float(itl.max())


def test_at_light_load_the_tail_is_a_decode_gap() -> None:
    p99, longest = itl_p99_and_max(0.2)
    # Prompts went in whole (a stall of 10 + 2 x 200..500 + 5 ms), too rarely to reach the p99: chunked
    # under the target, they would stall ten times as many gaps, and the p99 would be one of them (~100 ms).
    assert longest > 400
    assert p99 < 50


def test_under_load_stalls_keep_to_the_target() -> None:
    p99, longest = itl_p99_and_max(2.0)
    # 16 decode rows (~90 ms) beside the 32-token minimum chunk (64 ms): no whole prompt (>= 400 ms) stalls anyone.
    assert p99 > 90 and longest < 200
