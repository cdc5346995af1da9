"""`cobali batch` on the real model: results as JSONL, and a resumed job gives the same greedy text."""

from __future__ import annotations

import json
from pathlib import Path

from cobali.faces.cli import main

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time",
           "List three uses of a paperclip. First,"]
FLAGS = ["--max-new", "6", "--threads", "1", "--max-slots", "2", "--n-batch", "64"]


def test_batch_resumes_with_identical_outputs(tmp_path: Path, model_path: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    assert main(["batch", "--input", str(source), "--output", str(full), "--model", model_path, *FLAGS]) == 0
    lines = full.read_text().splitlines(keepends=True)
    assert len(lines) == len(PROMPTS)
    assert all(json.loads(x)["output_tokens"] == 6 for x in lines)
    resumed.write_text("".join(lines[:2]) + lines[2][:7])  # killed while writing the third result
    assert main(["batch", "--input", str(source), "--output", str(resumed), "--model", model_path, *FLAGS]) == 0
    assert sorted(resumed.read_text().splitlines()) == sorted(full.read_text().splitlines())
