"""The GPU kit's CPU dry run: bench/gpu/run.sh end to end on a tiny synthesized model, with this
checkout's llama-cpp-python instead of a CUDA build, so that the kit cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--shape", "tiny", "--slots", "4", "--num-prompts", "6", "--max-new", "4", "--variants", "threads1,kv-unified",
         "--probe-slots", "4",
         "--serve-workload", "workloads/short_burst.json", "--serve-prompts", "6", "--concurrency", "6",
         "--sweep-prompts", "workloads/short_burst.json", "--sweep-num-prompts", "6", "--sweep-rates", "8",
         "--sweep-repeat", "1"]


def run_kit(out: Path, work: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": sys.executable, "COBALI_GPU_WORK": str(work)}
    cmd = ["bash", "bench/gpu/run.sh", str(out), "--installed", "--cpu", "--", *SMALL]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_the_kit_runs_end_to_end_on_cpu_and_a_second_call_reuses_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run_kit(out, tmp_path / "work")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["table2"]["rows"]
    assert [r["config"] for r in rows] == ["seq", "static", "cont-split512", "cont-split256", "cont-split128",
                                           "cont-split512-async"]
    assert rows[0]["speedup"] == 1.0 and all(r["output_tok_s"] > 0 for r in rows)
    assert 0 < summary["table2"]["host"]["host_share"] < 1
    assert [v["name"] for v in summary["variants"]] == ["threads1", "kv-unified"]
    assert all(v["output_tok_s"] > 0 and v["vs_table2"] > 0 for v in summary["variants"])
    assert [(r["slots"], r["argmax_ms"] > 0) for r in summary["decode"]] == [(4, True), (4, True)]
    profile = summary["profile"]  # a fit's negative terms are clamped to 0 (noise), so one may be 0: not all
    assert profile["t0_s"] >= 0 and profile["t0_s"] + profile["prefill_s_per_token"] > 0
    assert (out / "profile.json").exists()
    assert summary["peers"]["cobali"]["output_tok_s"] > 0 and summary["peers"]["cobali-async"]["output_tok_s"] > 0
    assert "llama-server (no --bin)" in summary["skipped"]
    assert [row["rate"] for row in summary["sweep"]["servers"]["cobali"]["rows"]] == [8.0]
    assert [row["rate"] for row in summary["sweep"]["servers"]["cobali-no-compact"]["rows"]] == [8.0]
    text = (out / "summary.md").read_text()
    assert "| cont-split128 |" in text and "| kv-unified |" in text and "## Poisson sweep" in text
    assert (out / "kit.png").stat().st_size > 0

    again = run_kit(out, tmp_path / "work")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert [line for line in again.stdout.splitlines() if line.startswith("$ ")] == []
    assert json.loads((out / "summary.json").read_text())["variants"] == summary["variants"]


def test_the_kit_stops_at_its_deadline_with_the_resume_status(tmp_path: Path) -> None:
    cmd = [sys.executable, "bench/gpu/kit.py", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
           "--deadline-s", "0.001", "--n-gpu-layers", "0", *SMALL]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stdout[-2000:] + done.stderr[-2000:]
    assert "run the same command again to continue" in done.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_the_kit_names_a_bad_flag_value_and_runs_nothing(tmp_path: Path) -> None:
    base = [sys.executable, "bench/gpu/kit.py", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    for flags, message in ((["--variants", "threads1,nope"], "unknown variant(s) nope; known: threads1"),
                           (["--probe-slots", "16,x"], "expected comma-separated integers, got '16,x'"),
                           (["--batch-sizes", "a"], "expected comma-separated integers, got 'a'")):
        done = subprocess.run([*base, *flags], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr[-500:])
    assert not (tmp_path / "out").exists()
