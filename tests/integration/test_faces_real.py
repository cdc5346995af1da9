"""`cobali run` and `cobali calibrate` end to end on the embedded model, with few prompts and tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cobali.engine.costs import DEFAULT_PROFILE, CostProfile
from cobali.faces.cli import main

SMALL = ["--threads", "1", "--max-slots", "2", "--n-batch", "64"]


def test_run_reports_every_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\ndef fibonacci(n):\n1, 2, 3, 4, 5,\n")
    out = tmp_path / "run.json"
    argv = ["run", "--prompts", str(prompts), "--max-new", "4", "--ignore-eos", "--json", str(out), *SMALL]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "3 prompts, mode cont" in printed and "generated tokens    12" in printed
    data = json.loads(out.read_text())
    assert [r["output_tokens"] for r in data["requests"]] == [4, 4, 4]
    assert all(r["finish_reason"] == "length" and r["text"] and r["ttft_ms"] > 0 for r in data["requests"])
    assert data["summary"]["requests"] == 3 and data["summary"]["failed"] == 0


def test_calibrate_writes_to_the_user_cache_not_the_bundled_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COBALI_CACHE", str(tmp_path / "cache"))
    sample = tmp_path / "sample.txt"
    sample.write_text("A short sample of English text to count characters per token.\n")
    bundled = DEFAULT_PROFILE.read_bytes()
    # 1024 cells a sequence: 2 prefill sizes, 2 deep chunks below the tile at one depth (512), 1-2 rows at both decode
    # depths.
    argv = ["calibrate", *SMALL, "--ctx", "3072", "--repeats", "1", "--text-sample", str(sample)]
    assert main(argv) == 0
    assert DEFAULT_PROFILE.read_bytes() == bundled
    profile = CostProfile.load(tmp_path / "cache" / "profiles" / "calibrated.json")
    assert len(profile.measurements) == 8 and all(m.seconds > 0 for m in profile.measurements)
    assert sum(m.terms.short_prefill_kv_tokens > 0 for m in profile.measurements) == 2, "16 and 32 deep: short"
    assert profile.prefill_s_per_token > 0 and 2 < profile.chars_per_token < 8
    assert "llama" in profile.device
