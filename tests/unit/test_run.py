"""`cobali run` on the fake backend: what the engine did for the requests reaches its summary and JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.setup import EngineSetup
from cobali.faces.cli import main


def test_run_reports_preemptions_and_prefix_cache_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A KV pool too small for every request at once preempts (optimistic admission), and prompts that share a
    long prefix reuse its KV: the run says how often, and how many prompt tokens the cache gave."""
    monkeypatch.setattr(EngineSetup, "build_engine", lambda setup, backend=None: Engine(
        FakeBackend(n_seq_max=4, n_batch=64, kv_unified=True, n_ctx_seq=128), setup.engine))
    shared = "a shared system prompt, long enough to be reused: "
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"{shared}question {i}\n" for i in range(6)))
    out = tmp_path / "run.json"
    argv = ["run", "--prompts", str(prompts), "--max-new", "40", "--ignore-eos", "--max-slots", "4", "--n-batch", "64",
            "--kv-admission", "optimistic", "--host-cache-mib", "0", "--json", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())["summary"]
    records = json.loads(out.read_text())["requests"]
    assert summary["preemptions"] > 0 and summary["preemptions"] == sum(r["preemptions"] for r in records)
    assert summary["cached_tokens"] > 0 and summary["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    assert (f"engine              {summary['preemptions']} preemptions, {summary['cached_tokens']} prompt tokens "
            "from the prefix cache") in capsys.readouterr().out
