"""The deadline budget: prefill sized by the slack a TPOT SLO leaves every decoding request, on a virtual clock."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from cobali.config.flags import add_engine_args, engine_config
from cobali.engine.budget import AdaptiveBudget, DeadlineBudget, FixedBudget, tick_budget
from cobali.engine.costs import CostProfile, OnlineCostFit, TickTerms
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import Request, RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.harness.workloads import arrival_offsets
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimSpec, simulate

# 10 ms per tick, 2 ms per prefill token, 5 ms per decode row, 1 us per decode KV token.
PROFILE = CostProfile(t0_s=0.010, prefill_s_per_token=0.002, decode_s_per_row=0.005, decode_s_per_kv_token=1e-6)


def decoding_request(context: int, token_times: tuple[float, ...] = (0.0,), max_tokens: int = 16,
                     request_id: int = 0) -> Request:
    """A request in DECODE holding `context` tokens, which sampled its tokens at `token_times`."""
    n_out = len(token_times)
    request = Request(request_id, [1] * (context - n_out), SamplingParams(max_tokens=max_tokens), arrival_time=0.0,
                      state=RequestState.DECODE, output_tokens=[2] * n_out, token_times=list(token_times))
    request.computed_tokens = context - 1
    return request


def decoding(n: int, context: int) -> list[Request]:
    return [decoding_request(context, request_id=i) for i in range(n)]


def deadline(tpot_ms: float = 100, itl_max_ms: float = float("inf"), costs: OnlineCostFit | None = None,
             n_batch: int = 512) -> DeadlineBudget:
    return DeadlineBudget(costs or OnlineCostFit(PROFILE), tpot_ms / 1e3, itl_max_ms / 1e3, n_batch)


def test_the_next_token_is_due_by_the_slo_or_the_itl_bound() -> None:
    request = decoding_request(100, (1.0, 1.01, 1.02), max_tokens=5)
    # The 5th token is due at 1.0 + 4 x 0.1; the 4th, 20 ms (one decode tick) before it.
    assert deadline(100).due(request, decode_s=0.020, now=1.1) == pytest.approx(1.38)
    # 1.02 + 0.2 first:
    assert deadline(100, itl_max_ms=200).due(request, decode_s=0.020, now=1.1) == pytest.approx(1.22)


def test_a_fresh_request_lends_the_slack_its_later_tokens_leave() -> None:
    fresh = decoding_request(100, (0.0,), max_tokens=11)
    # Decode alone: 10 + 5 + 0.1 = 15.1 ms a tick; the 11th token is due at 1.0 s, so the 2nd at
    # 1.0 - 9 x 15.1 ms = 864.1 ms, and prefill gets (864.1 - 15.1) / 2 = 424 tokens.
    assert deadline(100).tokens([fresh], now=0.0) == 1 + 424


def test_prefill_gets_what_fits_in_the_slack() -> None:
    # One decode of 1000 tokens: 10 + 5 + 1 = 16 ms paid; due at 0.3, now 0.069: 231 ms slack -> 107 tokens.
    request = decoding_request(1000, (0.0, 0.05, 0.06), max_tokens=4)
    assert deadline(100).tokens([request], now=0.069) == 1 + 107


def test_the_tightest_deadline_decides() -> None:
    ahead = decoding_request(500, (0.0, 0.01, 0.02), max_tokens=4)
    behind = decoding_request(500, (0.0, 0.1), max_tokens=3, request_id=1)
    budget = deadline(100)
    # ahead is due at 0.3, behind at 0.2; now 0.03: 170 ms of slack, 10 + 10 + 1 = 21 ms for the decodes.
    assert budget.tokens([ahead, behind], now=0.03) == 2 + 74
    assert budget.tokens([ahead], now=0.03) == 1 + 127


def test_a_request_behind_its_schedule_leaves_the_minimum_chunk() -> None:
    late = decoding_request(100, (0.0, 0.2), max_tokens=3)  # its third and last token was due at 0.2
    assert deadline(100).tokens([late], now=0.25) == 1 + 32


def test_no_decodes_means_the_whole_batch() -> None:
    assert deadline(100).tokens([], now=5.0) == 512


def test_banked_slack_never_exceeds_the_batch() -> None:
    request = decoding_request(100, tuple(0.01 * i for i in range(100)), max_tokens=101)  # due at 10 s
    assert deadline(100, n_batch=256).tokens([request], now=1.0) == 256


def test_an_unconfident_fit_gets_the_minimum_chunk() -> None:
    learning = OnlineCostFit()
    for terms in (TickTerms(100, 1, 100), TickTerms(0, 1, 100), TickTerms(300, 0, 0)):
        learning.observe(terms, PROFILE.predict(TickTerms(terms.prefill_tokens, terms.decode_rows, 100)))
    assert not learning.confident
    request = decoding_request(100, tuple(0.01 * i for i in range(100)))
    assert deadline(100, costs=learning).tokens([request], now=1.0) == 1 + 32


def test_the_flags_pick_the_budget() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    pick = [tick_budget(engine_config(parser.parse_args(flags)), PROFILE) for flags in
            ([], ["--itl-target-ms", "250"], ["--tpot-slo-ms", "80", "--itl-max-ms", "400"], ["--tpot-slo-ms", "80"])]
    assert [type(b) for b in pick] == [FixedBudget, AdaptiveBudget, DeadlineBudget, DeadlineBudget]
    assert (pick[2].tpot_slo_s, pick[2].itl_max_s, pick[3].itl_max_s) == (0.08, 0.4, float("inf"))


@pytest.mark.parametrize("field", ["tpot_slo_ms", "itl_max_ms"])
def test_bad_settings_are_rejected(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: -1.0})


def run_beside_a_long_prompt(**budget_flags: float) -> tuple[Request, list[int], float]:
    """Request 0 decodes alone for 10 ticks (15 ms each, far under a 100 ms TPOT), then a 400-token prompt
    arrives. Ticks take the profile's time on the virtual clock, so predictions are exact.
    Returns request 0, the prompt's chunks, and its TTFT."""
    backend = SimBackend(PROFILE, n_seq_max=4, n_batch=512)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=512, **budget_flags), clock=backend.clock,
                    costs=PROFILE)
    first = engine.add_request([5] * 10, SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(10):
        engine.step()
    prompt = engine.add_request([6] * 400, SamplingParams(max_tokens=2, ignore_eos=True))
    list(LLM(engine).run())
    chunks = [c.n_tokens for t in engine.ticks for c in t.plan.chunks if c.request_id == prompt.id and c.n_tokens > 1]
    return first, chunks, prompt.token_times[0] - prompt.arrival_time


def gaps(request: Request) -> list[float]:
    return [b - a for a, b in zip(request.token_times, request.token_times[1:], strict=False)]


def test_slack_goes_into_one_long_chunk_and_the_slo_holds() -> None:
    _, fixed_chunks, fixed_ttft = run_beside_a_long_prompt(itl_target_ms=100)
    first, chunks, ttft = run_beside_a_long_prompt(tpot_slo_ms=100)
    assert fixed_chunks == [42] * 9 + [22]  # the fixed target: ten stalls near 100 ms
    assert chunks == [400]  # 60 tokens may take 5.9 s, decoding alone takes 0.9: the prompt in one tick
    assert ttft < fixed_ttft
    times = first.token_times
    assert (times[-1] - times[0]) / (len(times) - 1) <= 0.100  # the TPOT SLO holds


def test_the_budget_learns_from_every_tick_the_engine_runs() -> None:
    """Without a seeded profile the deadline budget starts unconfident and must learn the costs online."""
    backend = SimBackend(PROFILE, n_seq_max=4, n_batch=512)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=512, tpot_slo_ms=100), clock=backend.clock)
    for i in range(4):
        engine.add_request([5 + i] * (50 + 100 * i), SamplingParams(max_tokens=30, ignore_eos=True))
    list(LLM(engine).run())
    costs = engine._scheduler.budget.costs
    assert costs.n_ticks == len(engine.ticks) and costs.confident


def test_the_itl_bound_caps_one_gap() -> None:
    first, chunks, _ = run_beside_a_long_prompt(tpot_slo_ms=100, itl_max_ms=300)
    assert chunks == [142, 142, 116]  # (300 - 15 ms of decode) / 2 ms = 142 tokens a tick
    assert max(gaps(first)) <= 0.300 + 1e-9


def test_under_poisson_load_every_request_meets_the_slo_and_the_itl_bound() -> None:
    """40 prompts of 50-1500 tokens, 16-200 output tokens, arriving at 0.5/s on the virtual clock."""
    rng = np.random.default_rng(0)
    items = [SimItem([7] * int(rng.integers(50, 1500)), int(rng.integers(16, 200))) for _ in range(40)]
    # The load is held by prefix reuse (every prompt repeats one token): moving a request into a free slot drops
    # that slot's cached prefix, and the simulator does not price the forward pass the move saves. Nor does it
    # price restores from host memory, which would take most of the load away.
    config = EngineConfig(max_slots=8, n_batch=512, tpot_slo_ms=45, itl_max_ms=300, compact_slots=False,
                          host_cache_mib=0)
    spec = SimSpec(PROFILE, config, 2048)
    timings = [f.timing for f in simulate(items, arrival_offsets(40, 0.5, 1.0, 1).tolist(), spec).finished]
    assert max(t.tpot_ms for t in timings) <= 45
    # A chunk may take its prompt's short tail along past the budget: half a tile at most, 64 ms here.
    assert 250 < max(max(t.itl_ms) for t in timings) <= 300 + 64


def test_the_itl_target_is_a_floor_when_no_request_has_slack() -> None:
    late = decoding_request(100, (0.0, 0.2), max_tokens=3)  # its last token was due at 0.2
    floored = DeadlineBudget(OnlineCostFit(PROFILE), 0.100, float("inf"), 512, itl_floor_s=0.100)
    assert deadline(100).tokens([late], now=0.25) == 1 + 32
    assert floored.tokens([late], now=0.25) == 1 + 42  # (100 - 15 ms of decode) / 2 ms
    assert floored.tokens([late], now=0.0) == deadline(100).tokens([late], now=0.0)  # slack above the floor


def test_the_deadline_flags_keep_the_itl_target_as_a_floor() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with_floor, without = (tick_budget(engine_config(parser.parse_args(["--tpot-slo-ms", "80", *flags])), PROFILE)
                           for flags in (["--itl-target-ms", "250"], []))
    assert (with_floor.itl_floor_s, without.itl_floor_s) == (0.25, 0.0)
