"""The GPU kit's CPU dry run: bench/gpu/run.sh end to end on a tiny synthesized model, with this
checkout's llama-cpp-python instead of a CUDA build, so that the kit cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_kit_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PY": sys.executable, "COBALI_GPU_WORK": str(tmp_path / "work")}
    cmd = ["bash", "bench/gpu/run.sh", str(out), "--installed", "--cpu", "--", "--shape", "tiny", "--slots", "4",
           "--num-prompts", "6", "--max-new", "4", "--serve-workload", "workloads/short_burst.json",
           "--serve-prompts", "6", "--concurrency", "6"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["table2"]["rows"]
    assert [r["config"] for r in rows] == ["seq", "static", "cont-split512", "cont-split256", "cont-split128",
                                           "cont-split512-async"]
    assert rows[0]["speedup"] == 1.0 and all(r["output_tok_s"] > 0 for r in rows)
    assert 0 < summary["table2"]["host"]["host_share"] < 1
    assert summary["peers"]["cobali"]["output_tok_s"] > 0 and summary["peers"]["cobali-async"]["output_tok_s"] > 0
    assert "llama-server (no --bin)" in summary["skipped"]
    assert "| cont-split128 |" in (out / "summary.md").read_text()
    assert (out / "kit.png").stat().st_size > 0
