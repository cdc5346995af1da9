"""The simulator: SimBackend against FakeBackend, virtual time from the profile, simulate, plan search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.costs import CostProfile, TickTerms, load_profile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.calibrate import chars_per_token, measure_deep_prefill
from cobali.faces.cli import main
from cobali.frontend.offline import LLM
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimSpec, simulate
from cobali.sim.plan import plan_replicas

UNIT = CostProfile(t0_s=1.0, prefill_s_per_token=0.1, decode_s_per_row=0.01, decode_s_per_kv_token=0.001)


def prompts(n: int) -> list[list[int]]:
    return [[1 + (i * 7 + j * 5) % 90 for j in range(5 + (i * 13) % 40)] for i in range(n)]


@pytest.mark.parametrize(("kv_unified", "n_ctx_seq"), [(False, 4096), (True, 160)])
def test_sim_backend_gives_the_fake_backends_plans_and_tokens(kv_unified: bool, n_ctx_seq: int) -> None:
    config = EngineConfig(max_slots=4, prefill_chunk_tokens=16, n_batch=32, kv_admission="optimistic")
    runs = []
    for backend in (FakeBackend(4, n_ctx_seq, 32, kv_unified),
                    SimBackend(UNIT, n_seq_max=4, n_ctx_seq=n_ctx_seq, n_batch=32, kv_unified=kv_unified)):
        engine = Engine(backend, config, clock=getattr(backend, "clock", None) or (lambda: 0.0))
        requests = LLM(engine).generate(prompts(12), SamplingParams(max_tokens=30))
        runs.append(([t.plan for t in engine.ticks], [r.token_ids for r in requests], backend.kv))
    fake, sim = runs
    assert sim[0] == fake[0], "the same scheduler must plan the same ticks"
    assert sim[1] == fake[1] and sim[2] == fake[2]
    assert any(p.preempted for p in fake[0]) == kv_unified, "the small unified pool exercises preemption"


def rows(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def test_decode_advances_the_clock_by_the_profile() -> None:
    backend = SimBackend(UNIT, n_seq_max=2)
    backend.decode(rows(5, 6, 7, 8, 9), rows(0, 1, 2, 3, 4), rows(0, 0, 0, 0, 0), rows(0, 0, 0, 0, 1))
    assert backend.clock() == pytest.approx(1.0 + 5 * 0.1)
    # seq 0 decodes at position 5 (6 context tokens) while seq 1 prefills 3 tokens
    backend.decode(rows(1, 2, 3, 4), rows(5, 0, 1, 2), rows(0, 1, 1, 1), rows(1, 0, 0, 1))
    assert backend.clock() == pytest.approx(1.5 + 1.0 + 3 * 0.1 + 0.01 + 6 * 0.001)


def test_a_short_chunk_deep_in_a_sequence_costs_the_short_rate() -> None:
    costs = CostProfile(t0_s=0.0, prefill_s_per_token=0.0, decode_s_per_row=0.0, decode_s_per_kv_token=0.0,
                        prefill_s_per_kv_token=1e-3, short_chunk_s_per_kv_token=2e-3)
    for tile, per_depth in ((1, 1e-3), (8, 3e-3)):
        backend = SimBackend(costs, n_seq_max=1, prefill_tile=tile)
        backend.decode(rows(*range(1, 9)), rows(*range(8)), rows(*[0] * 8), rows(*[0] * 7, 1))  # 8 at depth 0
        assert backend.clock() == pytest.approx(8 * 7 / 2 * 1e-3), "within a chunk, its own earlier tokens"
        backend.decode(rows(1, 2, 3), rows(8, 9, 10), rows(0, 0, 0), rows(0, 0, 1))  # 3 at depth 8
        assert backend.clock() == pytest.approx(28e-3 + (3 * 8 + 3) * per_depth)


def test_engine_timestamps_are_virtual() -> None:
    backend = SimBackend(UNIT, n_seq_max=2)
    engine = Engine(backend, EngineConfig(max_slots=2, n_batch=64, record_ticks=False), clock=backend.clock)
    (r,) = LLM(engine).generate([list(range(1, 11))], SamplingParams(max_tokens=3, ignore_eos=True))
    # prefill of 10 tokens, then decode rows with 11 and 12 context tokens
    assert r.stats.token_times == pytest.approx([2.0, 2.0 + 1.021, 2.0 + 1.021 + 1.022])
    assert r.stats.arrival_time == 0.0 and r.stats.finish_time == pytest.approx(4.043) and not engine.ticks


def test_simulate_routes_over_replicas_and_reports() -> None:
    items = [SimItem(p, 8) for p in prompts(40)]
    spec = SimSpec(UNIT, EngineConfig(max_slots=4, n_batch=64, record_ticks=False), replicas=3)
    result = simulate(items, [0.5 * i for i in range(40)], spec)
    summary = result.summary()
    assert summary["requests"] == 40 and summary["failed"] == 0 and summary["unfinished"] == 0
    assert summary["generated_tokens"] == 40 * 8
    assert all(r.routed > 0 for r in result.replicas)
    assert summary["ttft_p50_ms"] >= 1000  # a tick costs at least t0 = 1 s
    assert summary["wall_s"] == pytest.approx(max(r.clock.now for r in result.replicas) - 0.0)


def test_plan_finds_the_fewest_replicas() -> None:
    # One slot per replica, each request one 10-token prefill tick of 0.1 s, all arriving at once: with K
    # replicas sharing 8 requests the slowest waits ceil(8 / K) ticks.
    costs = CostProfile(t0_s=0.0, prefill_s_per_token=0.01, decode_s_per_row=0.01, decode_s_per_kv_token=0.0)
    spec = SimSpec(costs, EngineConfig(max_slots=1, n_batch=16, record_ticks=False))
    items = [SimItem(list(range(1, 11)), 1) for _ in range(8)]
    best, trials = plan_replicas(items, [0.0] * 8, spec, target_ms=250)
    assert best.replicas == 4 and best.ttft_p99_ms == pytest.approx(200)
    assert [t.replicas for t in trials] == [1, 2, 4, 3]


def test_bundled_profiles_load() -> None:
    cpu = load_profile("cpu-2core-smollm2")  # measured by `cobali calibrate` on this 2-core CPU
    assert cpu.predict(TickTerms(0, 16, 0)) > cpu.predict(TickTerms(0, 1, 0)) > 0
    assert 150 < 256 / cpu.predict(TickTerms(256, 0, 0)) < 600, "prefill of the 135M model runs at ~300 tok/s"
    assert 4.0 < cpu.chars_per_token < 5.0, "the model's tokenizer, measured over mixed_length"
    assert "ESTIMATE" in load_profile("h100-llama-8b").device
    one = load_profile("cpu-1thread-smollm2")
    deep_short, deep_long = TickTerms(32, 0, 0, 32 * 1536, 32 * 1536), TickTerms(128, 0, 0, 128 * 1536)
    assert one.predict(deep_short) / 32 > 1.3 * one.predict(deep_long) / 128, "short chunks deep cost more a token"


def test_simulate_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--profile", "cpu-2core-smollm2", "--random-input-len", "64", "--random-output-len", "16",
            "--num-prompts", "30", "--request-rate", "1", "--max-slots", "4", "--replicas", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "requests            30 (0 failed)" in out and "TTFT" in out
    assert main([*argv, "--plan", "--target-ttft-p99", "2000"]) == 0
    assert "fewest replicas with TTFT p99 <= 2000 ms" in capsys.readouterr().out


def test_text_prompts_take_the_profiles_characters_per_token() -> None:
    backend = SimBackend(UNIT, chars_per_token=4.45)
    tokens = backend.tokenize("x" * 4450)
    assert len(tokens) == 1000 and all(0 < t < backend.n_vocab for t in tokens)
    assert len(backend.tokenize("abc")) == 1 and backend.tokenize("") == []
    assert len(SimBackend(UNIT).tokenize("abc")) == 3  # one token per character, as the fake backend


def test_simulate_sizes_text_prompts_by_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    CostProfile(0.01, 0.001, 0.001, 0.0, chars_per_token=2.0).save(profile)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("y" * 100 + "\n" + "z" * 60 + "\n")
    argv = ["simulate", "--profile", str(profile), "--prompts", str(prompts), "--max-new", "4"]
    assert main(argv) == 0
    assert "prompt tokens       80\n" in capsys.readouterr().out
    assert main([*argv, "--chars-per-token", "4"]) == 0
    assert "prompt tokens       40\n" in capsys.readouterr().out


def test_calibrate_times_short_chunks_deep_in_a_prompt_as_such() -> None:
    backend = FakeBackend(n_seq_max=1, n_ctx_seq=2048, n_batch=512, prefill_tile=65)
    points = measure_deep_prefill(backend, 0, n_batch=512, repeats=1)
    sizes = {m.terms.prefill_tokens for m in points}
    assert {s for s in sizes if s < 65} and {s for s in sizes if s >= 65}, "chunks on both sides of the tile"
    for m in points:
        assert m.terms.prefill_kv_tokens > 0
        short = m.terms.prefill_kv_tokens if m.terms.prefill_tokens < 65 else 0
        assert m.terms.short_prefill_kv_tokens == short


def test_calibrate_measures_characters_per_token() -> None:
    assert chars_per_token(FakeBackend(), ["hello", "world!"]) == 1.0  # the fake makes a token per character
    with pytest.raises(ValueError, match="--text-sample"):
        chars_per_token(FakeBackend(), [""])
