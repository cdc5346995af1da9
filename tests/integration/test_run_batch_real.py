"""`cobali run-batch` on the embedded model: OpenAI's Batch format in, results out, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cobali.faces.cli import main
from cobali.faces.synth_lora import write_random_lora

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}},
    {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "JSON please."}], "max_tokens": 48,
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}},
    {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"prompt": "1, 2, 3,", "max_tokens": 4}},
    {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a cat"}},
]


def test_run_batch_answers_every_line_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    # As a kill leaves it: one result written, the next cut short.
    results.write_text(json.dumps({"custom_id": "chat", "response": {"status_code": 200}}) + '\n{"custom_id": "js')
    assert main(["run-batch", "-i", str(source), "-o", str(results), "--max-slots", "2", "--threads", "1"]) == 0
    assert "4 requests, 1 already in" in capsys.readouterr().out
    written = [json.loads(line) for line in results.read_text().splitlines()]
    records = {r["custom_id"]: r for r in written}
    assert len(written) == 4 and set(records) == {"chat", "json", "text", "embed"}  # the finished one not rerun
    assert all(records[k]["response"]["status_code"] == 200 for k in ("json", "text", "embed"))
    assert json.loads(records["json"]["response"]["body"]["choices"][0]["message"]["content"])["ok"] in (True, False)
    assert len(records["embed"]["response"]["body"]["data"][0]["embedding"]) > 0
    assert main(["run-batch", "-i", str(source), "-o", str(results), "--max-slots", "2"]) == 0
    assert "0 to run" in capsys.readouterr().out


def test_run_batch_names_a_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"custom_id": "a", "url": "/v1/models", "body": {}}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 2 and "line 1: url '/v1/models'" in capsys.readouterr().err


def test_run_batch_serves_lora_modules(model_path: str, tmp_path: Path) -> None:
    """As vllm run-batch: a body may name an adapter given with --lora-modules."""
    adapter = tmp_path / "random.gguf"
    write_random_lora(model_path, str(adapter), rank=8, alpha=8.0, scale=0.2)
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": model, "url": "/v1/completions",
              "body": {"model": model, "prompt": "1, 2,", "max_tokens": 2}} for model in ("smol", "tuned")]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run-batch", "-i", str(source), "-o", str(results), "--served-model-name", "smol",
                 "--lora-modules", f"tuned={adapter}", "--threads", "1"]) == 0
    records = {r["custom_id"]: r["response"] for r in map(json.loads, results.read_text().splitlines())}
    assert {k: (r["status_code"], r["body"]["model"]) for k, r in records.items()} == {
        "smol": (200, "smol"), "tuned": (200, "tuned")}
