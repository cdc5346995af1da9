"""`cobali bench` on the fake backend: configs, sweeps, arrivals, the table, summary.json, plots, trace."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.costs import CostProfile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.faces import bench as bench_cli
from cobali.faces import cli
from cobali.harness import plots
from cobali.harness.configs import parse_configs, sweep_configs
from cobali.harness.driver import LoadOptions, run_workload
from cobali.harness.report import gaps_ms
from cobali.harness.workloads import WorkItem, arrival_offsets, inter_arrivals, random_items, resolve_prompts
from cobali.sim.backend import SimBackend

PROMPTS = ["hello world", "the quick brown fox jumps over", "short", "a longer prompt with more characters",
           "abc", "zyxwvu"]
CONFIGS = ["seq", "static", "cont-split8", "cont-split4"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(argv: list[str], built: list | None = None) -> str:
    """cobali.faces.cli.main with the fake backend in place of llama.cpp; returns stdout."""
    def fake_backend(config):
        backend = FakeBackend(n_seq_max=config.n_seq_max, n_batch=config.n_batch)
        if built is not None:
            built.append(backend)
        return backend

    out = io.StringIO()
    with mock.patch.object(bench_cli, "build_backend", fake_backend), contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp / "results"
    stdout = run_cli(["bench", "--prompts", str(prompts), "--configs", ",".join(CONFIGS), "--max-slots", "4",
                      "--n-batch", "16", "--max-new", "6", "--ignore-eos", "--out", str(out),
                      "--trace", str(out / "trace.json")])
    return stdout, out


# ---- configs and sweeps ---------------------------------------------------------------------------


def test_config_names_map_to_modes_and_chunks() -> None:
    configs = parse_configs("seq,static,cont,cont-split128", max_slots=8, prefill_chunk_tokens=512)
    assert [(c.name, c.mode, c.max_slots, c.prefill_chunk_tokens) for c in configs] == [
        ("seq", "seq", 8, 512), ("static", "static", 8, 512), ("cont", "cont", 8, 512),
        ("cont-split128", "cont", 8, 128)]


def test_an_async_suffix_turns_on_async_scheduling_for_that_config_only() -> None:
    plain, overlapped = parse_configs("cont-split128,cont-split128-async", max_slots=8, prefill_chunk_tokens=512)
    assert (overlapped.mode, overlapped.prefill_chunk_tokens) == ("cont", 128)
    assert not plain.engine_config(EngineConfig()).async_scheduling
    assert overlapped.engine_config(EngineConfig()).async_scheduling
    assert plain.engine_config(EngineConfig(async_scheduling=True)).async_scheduling, "the flag still counts"


@pytest.mark.parametrize("text, named", [("seq,bogus", "'bogus'"), ("cont-split0", "'cont-split0'"),
                                         ("cont-async-async", "'cont-async-async'"),
                                         ("seq,seq", "seq given twice")])
def test_bad_config_names_are_named_in_the_error(text: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_configs(text, 4, 512)


def test_sweep_grid_is_the_cartesian_product_in_cont_mode() -> None:
    configs = sweep_configs(["max-slots=8,4", "prefill-chunk-tokens=128,256"], max_slots=16,
                            prefill_chunk_tokens=512)
    assert [(c.name, c.mode, c.max_slots, c.prefill_chunk_tokens) for c in configs] == [
        ("cont-slots4-split128", "cont", 4, 128), ("cont-slots4-split256", "cont", 4, 256),
        ("cont-slots8-split128", "cont", 8, 128), ("cont-slots8-split256", "cont", 8, 256)]
    assert configs[0].knobs == {"max-slots": 4, "prefill-chunk-tokens": 128}


@pytest.mark.parametrize("sweep, named", [("max-slots=4,x", "'max-slots=4,x'"), ("batch=4", "'batch=4'"),
                                          ("max-slots=0,4", "positive")])
def test_bad_sweeps_are_named_in_the_error(sweep: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        sweep_configs([sweep], 4, 512)


def test_cli_reports_bad_input_with_the_value(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hi\n")
    for argv, named in [
        (["--prompts", str(prompts), "--configs", "seq,bogus"], "bogus"),
        (["--prompts", str(prompts), "--sweep", "max-slots=2,oops"], "max-slots=2,oops"),
        (["--prompts", "no_such_scenario"], "no_such_scenario"),
        (["--prompts", str(prompts), "--configs", "seq", "--sweep", "max-slots=2"], "exclusive"),
        (["--random-input-len", "8", "--random-range-ratio", "1.5"], "1.5"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(["bench", *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "cobali bench: error:" in err and named in err, (argv, err)


# ---- workloads and arrivals ---------------------------------------------------------------------


def test_poisson_and_gamma_inter_arrivals_are_seeded_with_mean_one_over_rate() -> None:
    poisson = inter_arrivals(40_000, rate=5.0, burstiness=1.0, seed=7)
    assert np.array_equal(poisson, inter_arrivals(40_000, rate=5.0, burstiness=1.0, seed=7))
    assert not np.array_equal(poisson, inter_arrivals(40_000, rate=5.0, burstiness=1.0, seed=8))
    assert poisson.mean() == pytest.approx(0.2, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = inter_arrivals(40_000, rate=5.0, burstiness=0.25, seed=7)
    assert bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)  # gamma: CV 1/sqrt(shape)


def test_arrival_offsets_start_at_zero_and_accumulate_the_gaps() -> None:
    offsets = arrival_offsets(5, rate=2.0, seed=3)
    gaps = inter_arrivals(5, rate=2.0, seed=3)
    assert offsets[0] == 0.0
    assert offsets == pytest.approx(np.concatenate([[0.0], np.cumsum(gaps[:-1])]))
    assert not arrival_offsets(4, rate=float("inf")).any()
    with pytest.raises(ValueError, match="-1"):
        inter_arrivals(3, rate=-1.0)


def test_random_items_are_seeded_token_prompts_within_the_length_range() -> None:
    items = random_items(50, input_len=100, output_len=20, range_ratio=0.5, n_vocab=50_000, seed=1)
    assert items == random_items(50, input_len=100, output_len=20, range_ratio=0.5, n_vocab=50_000, seed=1)
    lengths = [len(i.prompt) for i in items]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 10
    assert all(100 <= t < 49_900 for i in items for t in i.prompt)
    assert all(10 <= i.max_tokens <= 30 for i in items)


def test_scenario_names_resolve_to_workloads_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "tiny_case.json").write_text('{"requests": [{"prompt": "x"}]}')
    monkeypatch.chdir(tmp_path)
    assert resolve_prompts("tiny_case").resolve() == (tmp_path / "workloads" / "tiny_case.json").resolve()
    with pytest.raises(ValueError, match="tiny_case"):  # the error lists the scenarios it knows
        resolve_prompts("nope")


# ---- open-loop arrivals -------------------------------------------------------------------------


def test_open_loop_submits_at_arrival_times_and_excludes_idle_from_gaps() -> None:
    # On a simulated clock (10 ms a decode, no host time), so nothing here depends on this machine's speed.
    backend = SimBackend(CostProfile(0.01, 0.0, 0.0, 0.0), n_seq_max=2, n_batch=16)
    engine = Engine(backend, EngineConfig(max_slots=2, n_batch=16, prefill_chunk_tokens=4), clock=backend.clock)
    offsets = (0.0, 0.08, 0.16)
    load = LoadOptions(max_new=3, ignore_eos=True, request_rate=12.5, arrival_offsets=offsets)
    run = run_workload(engine, [WorkItem("abcdef", 3)] * 3, load, progress=None, sleep=backend.clock.advance)
    stats = [o.stats for o in run.outputs]
    starts = [s.arrival_time - stats[0].arrival_time for s in stats]
    assert starts == pytest.approx(offsets, abs=1e-9)
    assert all(s.first_scheduled_time >= s.arrival_time and s.n_output_tokens == 3 for s in stats)
    assert run.wall_s >= 0.16
    assert run.idle_after, "the engine must have idled between the spaced arrivals"
    # The 80 ms waits are not host overhead: with them excluded, no gap is left.
    assert max(gaps_ms(run.ticks, run.idle_after)) == 0
    assert max(gaps_ms(run.ticks)) >= 40


# ---- the offline comparison on the fake backend ---------------------------------------------------


def test_table_has_a_row_per_config_and_speedup_one_for_the_first(bench_run: tuple[str, Path]) -> None:
    stdout, out = bench_run
    rows = [line.split() for line in stdout.splitlines() if line.split() and line.split()[0] in CONFIGS]
    assert [r[0] for r in rows] == CONFIGS + CONFIGS  # the metrics table, then the host-gap table
    assert rows[0][6] == "1.00"
    summary = json.loads((out / "summary.json").read_text())
    runs = summary["runs"]
    assert [r["config"] for r in runs] == CONFIGS
    assert runs[0]["speedup"] == 1.0
    assert all(r["requests"] == len(PROMPTS) and r["failed"] == 0 for r in runs)
    assert all(r["generated_tokens"] == 6 * len(PROMPTS) for r in runs)
    assert runs[2]["engine"] == {"name": "cont-split8", "mode": "cont", "max_slots": 4,
                                 "prefill_chunk_tokens": 8, "knobs": {}, "async_scheduling": None}
    assert runs[0]["wasted_decode_slots"] > 0 and runs[3]["wasted_decode_slots"] == 0
    assert set(runs[0]["gap_ms"]) == {"count", "mean", "p50", "p75", "p90", "p95", "max"}
    assert runs[0]["gap_ms"]["count"] == runs[0]["ticks"] - 1


def test_every_config_generates_the_same_text_on_the_shared_backend(bench_run: tuple[str, Path]) -> None:
    _, out = bench_run
    texts = {c: [r["text"] for r in json.loads((out / f"requests_{c}.json").read_text())] for c in CONFIGS}
    assert len(texts["seq"]) == len(PROMPTS)
    assert all(t == texts["seq"] for t in texts.values())


def test_plots_are_non_empty_pngs(bench_run: tuple[str, Path]) -> None:
    _, out = bench_run
    names = ["throughput.png", "latency_cdf.png", "gap_hist.png"]
    names += [f"{kind}_{c}.png" for c in CONFIGS for kind in ("timeline", "tokens")]
    for name in names:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000, name


def test_tick_profile_csv_has_one_row_per_tick(bench_run: tuple[str, Path]) -> None:
    _, out = bench_run
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "ticks_static.csv").read_text().splitlines()
    assert lines[0].split(",")[:4] == ["tick", "start_ms", "end_ms", "decode_ms"]
    assert len(lines) - 1 == summary["runs"][1]["ticks"]


def test_trace_is_valid_trace_event_json(bench_run: tuple[str, Path]) -> None:
    _, out = bench_run
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert events and all({"ph", "pid", "tid", "name"} <= set(e) for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], float | int) and e["dur"] >= 0 for e in spans)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == set(CONFIGS)
    for pid in range(len(CONFIGS)):
        ticks = [e for e in spans if e["pid"] == pid and e["cat"] == "tick"]
        decodes = [e for e in spans if e["pid"] == pid and e["cat"] == "decode"]
        assert len(ticks) == len(decodes) > 0
        for tick, decode in zip(ticks, decodes, strict=True):  # llama_decode nests inside its tick
            assert tick["ts"] <= decode["ts"]
            assert decode["ts"] + decode["dur"] <= tick["ts"] + tick["dur"] + 1e-3
        per_request = [e for e in spans if e["pid"] == pid and e["cat"] == "request"]
        expected = ["queued", "prefill", "decode"] * len(PROMPTS)
        assert sorted(e["name"] for e in per_request) == sorted(expected)


def test_sweep_builds_one_backend_sized_for_the_largest_max_slots(tmp_path: Path) -> None:
    built: list[FakeBackend] = []
    stdout = run_cli(["bench", "--random-input-len", "12", "--random-output-len", "3", "--num-prompts", "5",
                      "--sweep", "max-slots=2,3", "--sweep", "prefill-chunk-tokens=4,8", "--max-slots", "1",
                      "--n-batch", "16", "--ignore-eos", "--out", str(tmp_path)], built)
    assert [b.n_seq_max for b in built] == [3]
    runs = json.loads((tmp_path / "summary.json").read_text())["runs"]
    assert [r["config"] for r in runs] == ["cont-slots2-split4", "cont-slots2-split8", "cont-slots3-split4",
                                           "cont-slots3-split8"]
    assert all(r["generated_tokens"] == 15 for r in runs)
    for knob in ("max-slots", "prefill-chunk-tokens"):
        assert (tmp_path / f"sweep_{knob}.png").read_bytes().startswith(PNG_MAGIC)
    assert "cont-slots3-split8" in stdout


def test_engine_flags_reach_every_bench_config() -> None:
    base = EngineConfig(n_batch=64, policy="prefill-first", kv_admission="reserve", prefix_cache=False)
    for config in parse_configs("seq,cont-split8", 4, 32):
        engine_config = config.engine_config(base)
        assert (engine_config.policy, engine_config.kv_admission, engine_config.prefix_cache) == (
            "prefill-first", "reserve", False)
        assert engine_config.max_slots == 4 and engine_config.n_batch == 64


def test_without_matplotlib_bench_names_the_plot_extra_and_still_writes_the_data(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib is the optional extra `plot`: a slim install benchmarks, says what to install, draws nothing."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "matplotlib" else real_find_spec(name, *args))
    stdout = run_cli(["bench", "--random-input-len", "8", "--num-prompts", "3", "--max-new", "2",
                      "--configs", "cont", "--out", str(tmp_path)])
    assert "cobali bench: no plots: matplotlib is not installed" in capsys.readouterr().err
    assert "pip install 'cobali[plot]'" in plots.MISSING
    assert (tmp_path / "summary.json").exists() and list(tmp_path.glob("*.png")) == []
    assert f"wrote 3 files to {tmp_path}" in stdout


def test_the_command_line_loads_no_plotting_library() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, cobali.faces.cli; print('matplotlib' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
