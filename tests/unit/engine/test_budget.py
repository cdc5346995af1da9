"""Adaptive chunking: the tick budget a cost profile allows under an ITL target."""

from __future__ import annotations

import pytest

from cobali.engine.budget import AdaptiveBudget
from cobali.engine.costs import CostProfile, Measurement, OnlineCostFit, TickTerms, chunk_kv_tokens
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import Chunk, ChunkKind, Plan
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.sim.backend import SimBackend
from tests.unit.engine.test_deadline_budget import decoding

# 10 ms per tick, 2 ms per prefill token, 5 ms per decode row, 1 us per decode KV token.
PROFILE = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6)


def test_prefill_gets_what_fits_under_the_target() -> None:
    budget = AdaptiveBudget(OnlineCostFit(PROFILE), itl_target_s=0.250, n_batch=512)
    # 4 decodes with 1000 KV tokens: 10 + 20 + 1 = 31 ms paid, 219 ms left -> 109 tokens.
    assert budget.prefill_tokens(4, 1000) == 109
    assert budget.tokens(decoding(4, 250)) == 113


def test_a_deep_prefill_gets_fewer_tokens() -> None:
    deep = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6,
                       prefill_s_per_kv_token=1e-6)
    budget = AdaptiveBudget(OnlineCostFit(deep), itl_target_s=0.250, n_batch=512)
    assert budget.prefill_tokens(4, 1000, prefill_depth=0) == 109
    # Resuming at position 2000, each token also attends to 2000 earlier ones: 2 + 2 = 4 ms a token.
    assert budget.prefill_tokens(4, 1000, prefill_depth=2000) == 54
    assert deep.predict(TickTerms(64, 0, 0, prefill_kv_tokens=64 * 2000)) == pytest.approx(0.010 + 0.128 + 0.128)


def test_no_decodes_means_the_whole_batch() -> None:
    assert AdaptiveBudget(OnlineCostFit(PROFILE), 0.250, 512).prefill_tokens(0, 0) == 512


def test_a_target_too_tight_still_leaves_the_minimum_chunk() -> None:
    budget = AdaptiveBudget(OnlineCostFit(PROFILE), itl_target_s=0.020, n_batch=512, min_chunk=32)
    assert budget.prefill_tokens(16, 8000) == 32


def test_budget_never_exceeds_n_batch() -> None:
    budget = AdaptiveBudget(OnlineCostFit(PROFILE), itl_target_s=10.0, n_batch=256)
    assert budget.tokens(decoding(16, 6)) == 256


def test_bad_target_is_rejected() -> None:
    with pytest.raises(ValueError, match="ITL target"):
        AdaptiveBudget(OnlineCostFit(PROFILE), itl_target_s=0.0, n_batch=256)


def decode_beside_a_long_prompt(costs: CostProfile, n_decode: int, prompt_len: int) -> Engine:
    """Request 0 (10 prompt tokens) decodes while request 1's prompt is prefilled under a 100 ms target.
    Ticks take the profile's time, so the fit it seeds stays where it is."""
    backend = SimBackend(costs, n_seq_max=4, n_batch=512)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=512, prefill_chunk_tokens=512, itl_target_ms=100),
                    clock=backend.clock, costs=costs)
    engine.add_request([5] * 10, SamplingParams(max_tokens=n_decode, ignore_eos=True))
    engine.step()
    engine.add_request([6] * prompt_len, SamplingParams(max_tokens=2, ignore_eos=True))
    list(LLM(engine).run())
    return engine


def test_engine_plans_follow_the_adaptive_budget() -> None:
    engine = decode_beside_a_long_prompt(PROFILE, n_decode=50, prompt_len=400)
    sizes = [[(c.request_id, c.n_tokens) for c in t.plan.chunks] for t in engine.ticks[:4]]
    # One decode row (5 ms + 11 us of KV) beside 10 ms fixed: (100 - 15.011) / 2 -> 42 prefill tokens a tick.
    assert sizes == [[(0, 10)], [(0, 1), (1, 42)], [(0, 1), (1, 42)], [(0, 1), (1, 42)]]


def test_chunks_shrink_as_a_long_prompt_goes_deeper() -> None:
    deep = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6,
                       prefill_s_per_kv_token=1e-5)
    engine = decode_beside_a_long_prompt(deep, n_decode=40, prompt_len=300)
    chunks = [c.n_tokens for t in engine.ticks for c in t.plan.chunks if c.request_id == 1 and c.n_tokens > 1]
    # At depth d a token costs 2 ms + 10 us x d: 42 tokens at 0, then 35 at 42, then 30 at 77 but never
    # under the 32-token minimum chunk.
    assert chunks[:4] == [42, 35, 32, 32]
    assert sum(chunks) == 300


def test_fit_recovers_known_coefficients() -> None:
    truth = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6,
                        prefill_s_per_kv_token=3e-6, short_chunk_s_per_kv_token=2e-6)
    tile = 64
    terms = [TickTerms(p, d, d * kv, p * depth, p * depth if p < tile else 0)
             for p in (0, 32, 256) for d in (0, 1, 8) for kv in (100, 700) for depth in (0, 500) if p or d]
    fitted = CostProfile.fit([Measurement(t, truth.predict(t)) for t in terms], device="test", source="unit")
    for name in ("t0_s", "prefill_s_per_token", "decode_s_per_row", "decode_s_per_kv_token", "prefill_s_per_kv_token",
                 "short_chunk_s_per_kv_token"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)


def test_a_short_chunk_deep_in_a_prompt_costs_its_own_rate() -> None:
    """A chunk shorter than the backend's prefill tile attends row by row: its depth is priced again."""
    profile = CostProfile(0.0, 0.004, 0.005, 1e-6, prefill_s_per_kv_token=1e-6, short_chunk_s_per_kv_token=2e-6)
    short = Plan(0, (Chunk(1, 0, ChunkKind.PREFILL, 1500, 21, 1521, True),))
    long = Plan(0, (Chunk(1, 0, ChunkKind.PREFILL, 1500, 128, 1628, False),))
    deep = 21 * 1500 + 21 * 20 // 2  # the prompt before it, and its own earlier tokens
    assert TickTerms.of_plan(short, prefill_tile=65).short_prefill_kv_tokens == deep == chunk_kv_tokens(21, 1500)
    assert TickTerms.of_plan(long, prefill_tile=65).short_prefill_kv_tokens == 0
    assert TickTerms.of_plan(long).prefill_kv_tokens == 128 * 1500 + 128 * 127 // 2
    assert TickTerms.of_plan(short).short_prefill_kv_tokens == 0, "a backend with no tile has no short chunks"
    assert profile.predict(TickTerms.of_plan(short, 65)) == pytest.approx(21 * 0.004 + deep * 3e-6)
    # Fitted with no short chunk measured (an older profile's points), the term is 0, not noise.
    points = [Measurement(TickTerms(p, 0, 0, p * d), 0.004 * p + 1e-6 * p * d) for p in (64, 256) for d in (0, 900)]
    assert CostProfile.fit(points, device="d", source="s").short_chunk_s_per_kv_token == 0.0


def test_profile_round_trips_through_json(tmp_path) -> None:
    path = tmp_path / "p.json"
    fitted = CostProfile.fit([Measurement(TickTerms(1, 0, 0), 0.01), Measurement(TickTerms(2, 0, 0), 0.02),
                              Measurement(TickTerms(0, 1, 5), 0.03), Measurement(TickTerms(0, 2, 10), 0.05)],
                             device="d", source="s")
    fitted.save(path)
    assert CostProfile.load(path) == fitted
    with pytest.raises(ValueError, match="cannot read"):
        CostProfile.load(tmp_path / "missing.json")


def test_a_short_tail_rides_along_past_the_budget() -> None:
    """The budget allows 64 tokens (the tile floor), but 64 + 36 would leave a 36-token tail on the slow
    path: the 100-token prompt goes in whole."""
    backend = SimBackend(PROFILE, n_seq_max=4, n_batch=512, prefill_tile=64)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=512, prefill_chunk_tokens=512, itl_target_ms=100),
                    clock=backend.clock, costs=PROFILE)
    engine.add_request([5] * 10, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.add_request([6] * 100, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request([7] * 300, SamplingParams(max_tokens=2, ignore_eos=True))
    list(LLM(engine).run())
    chunks = [(c.request_id, c.n_tokens) for t in engine.ticks for c in t.plan.chunks if c.n_tokens > 1]
    assert chunks[:3] == [(0, 10), (1, 100), (2, 64)]
    # The 300-token prompt: 64, 64, then 172 = 64 + 108 would end in one 108-token tick, so it halves.
    assert [n for r, n in chunks if r == 2] == [64, 64, 86, 86]
