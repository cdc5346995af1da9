"""Tick costs learned online: convergence, adaptation when the costs change, confidence, and the ITL
budget they drive in the engine. Virtual clocks only: no wall-clock thresholds."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.engine.costs import CostProfile, OnlineCostFit, TickTerms
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.sim.backend import SimBackend

TRUTH = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6,
                    prefill_s_per_kv_token=3e-6)


class ScaledCosts:
    """A device whose costs can be multiplied mid-run (another tenant arrives, the clock throttles)."""

    def __init__(self, base: CostProfile) -> None:
        self.base = base
        self.factor = 1.0

    def predict(self, terms: TickTerms) -> float:
        return self.factor * self.base.predict(terms)


def random_ticks(n: int, seed: int) -> list[TickTerms]:
    """Batches like a serving engine's: decode-only, prefill-only and mixed, at varied depths."""
    rng = np.random.default_rng(seed)
    ticks = []
    for _ in range(n):
        decode = int(rng.integers(0, 17))
        prefill = int(rng.choice([0, 65, 128, 512])) if decode else int(rng.choice([65, 128, 512]))
        ticks.append(TickTerms(prefill, decode, decode * int(rng.integers(10, 1500)),
                               prefill * int(rng.integers(0, 1500))))
    return ticks


def seconds(costs, terms: TickTerms) -> float:
    return costs.predict(terms)


def held_out_error(fit: OnlineCostFit, costs) -> float:
    """Worst relative error of the fit's predictions on batches it never saw."""
    return max(abs(fit.predict(t) - seconds(costs, t)) / seconds(costs, t) for t in random_ticks(50, seed=99))


def test_the_fit_converges_to_the_true_costs() -> None:
    fit = OnlineCostFit()
    for terms in random_ticks(100, seed=0):
        fit.observe(terms, seconds(TRUTH, terms))
    assert fit.confident
    assert held_out_error(fit, TRUTH) < 0.01
    assert fit.predict(TickTerms(1, 0, 0)) - fit.predict(TickTerms(0, 0, 0)) == pytest.approx(0.002, rel=0.02)


def test_it_converges_through_noise() -> None:
    rng = np.random.default_rng(1)
    fit = OnlineCostFit()
    for terms in random_ticks(200, seed=2):
        fit.observe(terms, seconds(TRUTH, terms) * (1 + 0.05 * rng.standard_normal()))
    assert fit.confident
    assert held_out_error(fit, TRUTH) < 0.08


def test_it_is_not_confident_before_it_has_seen_prefill_and_decode() -> None:
    fit = OnlineCostFit()
    decode_only = [TickTerms(0, d, d * 100) for d in range(1, 17)] * 5
    for terms in decode_only:
        fit.observe(terms, seconds(TRUTH, terms))
    assert not fit.confident
    fresh = OnlineCostFit()
    for terms in random_ticks(OnlineCostFit().min_ticks - 1, seed=0):
        fresh.observe(terms, seconds(TRUTH, terms))
    assert not fresh.confident


def test_it_adapts_when_the_cost_doubles() -> None:
    costs = ScaledCosts(TRUTH)
    fit = OnlineCostFit()
    confidence = []
    for i, terms in enumerate(random_ticks(200, seed=3)):
        costs.factor = 2.0 if i >= 100 else 1.0
        fit.observe(terms, seconds(costs, terms))
        confidence.append(fit.confident)
    assert all(confidence[30:100])
    assert not all(confidence[100:115])  # the change is noticed...
    assert all(confidence[160:])  # ...and learned
    assert held_out_error(fit, costs) < 0.02


def test_it_follows_a_slow_drift_without_losing_confidence() -> None:
    """Costs creeping up 50 % over 300 ticks never look like a change, so only forgetting follows them."""
    costs = ScaledCosts(TRUTH)
    fit = OnlineCostFit()
    for i, terms in enumerate(random_ticks(400, seed=6)):
        costs.factor = 1.0 + 0.5 * min(max(i - 100, 0) / 300, 1.0)
        fit.observe(terms, seconds(costs, terms))
        assert fit.confident or i < 100
    assert held_out_error(fit, costs) < 0.1  # without forgetting: 25 %


def test_a_seeded_fit_is_confident_at_once_and_unlearns_a_wrong_seed() -> None:
    fit = OnlineCostFit(seed=TRUTH)
    assert fit.confident
    assert fit.predict(TickTerms(100, 4, 2000)) == pytest.approx(TRUTH.predict(TickTerms(100, 4, 2000)))
    costs = ScaledCosts(TRUTH)
    costs.factor = 3.0
    for terms in random_ticks(150, seed=4):
        fit.observe(terms, seconds(costs, terms))
    assert fit.confident
    assert held_out_error(fit, costs) < 0.02


def test_a_coefficient_no_tick_exercises_keeps_its_estimate() -> None:
    fit = OnlineCostFit()
    for terms in random_ticks(100, seed=5):
        fit.observe(terms, seconds(TRUTH, terms))
    for step in range(1000):  # a long decode-only stretch says nothing about prefill
        terms = TickTerms(0, 1 + step % 16, (1 + step % 16) * (100 + step))
        fit.observe(terms, seconds(TRUTH, terms))
    per_token = fit.predict(TickTerms(1, 0, 0)) - fit.predict(TickTerms(0, 0, 0))
    assert per_token == pytest.approx(0.002, rel=0.05)
    assert np.isfinite(fit.cov).all() and np.trace(fit.cov) < 100


def serve_under_target(costs: ScaledCosts, double_at_tick: int | None = None) -> Engine:
    """One long decode beside a stream of 600-token prompts, under a 250 ms ITL target, no profile."""
    backend = SimBackend(costs, n_seq_max=4, n_batch=512)
    # The budget's own chunk sizes: a two-pass layout would cut a chunk beside a prompt's short tail to its length.
    config = EngineConfig(max_slots=4, n_batch=512, itl_target_ms=250, two_pass_ticks=False)
    engine = Engine(backend, config, clock=backend.clock)
    if double_at_tick is not None:
        engine.on_tick = lambda record: setattr(costs, "factor", 2.0 if len(engine.ticks) >= double_at_tick else 1.0)
    engine.add_request([5] * 10, SamplingParams(max_tokens=400, ignore_eos=True))
    for i in range(40):
        engine.add_request([6 + i % 50] * 600, SamplingParams(max_tokens=2, ignore_eos=True))
    list(LLM(engine).run())
    return engine


def mixed_prefill(engine: Engine) -> list[int]:
    """Prefill tokens of each tick that also decodes (the ticks whose size the ITL target sets)."""
    return [t.plan.n_prefill_tokens if t.plan.n_decode and t.plan.n_prefill_tokens else 0 for t in engine.ticks]


def test_the_engine_starts_conservative_then_budgets_from_what_it_learned() -> None:
    costs = ScaledCosts(CostProfile(0.010, 0.002, 0.005, 1e-6, 1e-7))
    engine = serve_under_target(costs)
    prefill = mixed_prefill(engine)
    first_mixed = next(i for i, n in enumerate(prefill) if n)
    assert prefill[first_mixed] == 32  # not confident yet: the minimum chunk
    late = [n for n in prefill[40:] if n]
    # Confident: what fits under 250 ms beside one decode row, 116 tokens (fewer beside more rows).
    assert len(late) > 100 and np.median(late) == pytest.approx(116, abs=2) and min(late) > 60
    times = [t.end - t.start for t in engine.ticks[40:] if t.plan.n_decode]
    assert max(times) <= 0.250 * 1.02


def test_the_engine_halves_its_chunks_when_the_cost_doubles() -> None:
    steady = mixed_prefill(serve_under_target(ScaledCosts(CostProfile(0.010, 0.002, 0.005, 1e-6, 1e-7))))
    costs = ScaledCosts(CostProfile(0.010, 0.002, 0.005, 1e-6, 1e-7))
    engine = serve_under_target(costs, double_at_tick=80)
    doubled = mixed_prefill(engine)
    before = [n for n in steady[40:80] if n]
    after = [n for n in doubled[120:] if n]
    assert len(after) > 50
    # Twice the cost per token, and twice the decode row's: (250 - 2 x 15) / 4 ms = 55 tokens, not 116.
    assert np.mean(after) == pytest.approx(np.mean(before) * 55 / 116, rel=0.1)
    late = [t for t in engine.ticks[120:] if t.plan.n_decode and t.plan.n_prefill_tokens]
    assert max(t.end - t.start for t in late) <= 0.250 * 1.02
