"""`cobali batch --ray`: two Ray workers, one engine each, give the single-process results, byte for byte,
with two sequences sharing each batch (each shard of 8 prompts runs whole wherever it runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cobali.faces.cli import main

pytest.importorskip("ray")

BASES = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Once upon a time",
         "List three uses of a paperclip. First,", "Translate to French: Good morning", "My favourite colour",
         "The best way to learn Python"]
PROMPTS = [f"{base} (take {i})" for i in range(2) for base in BASES]
FLAGS = ["--max-new", "5", "--threads", "1", "--max-slots", "2", "--n-batch", "64"]


@pytest.mark.timeout(240)  # starts a local Ray cluster (several processes): 10-20 s on 2 cores
def test_ray_batch_matches_one_process(tmp_path: Path, model_path: str) -> None:
    import ray

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    local, distributed = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert main(["batch", "--input", str(source), "--output", str(local), "--model", model_path, *FLAGS]) == 0
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        argv = ["batch", "--input", str(source), "--output", str(distributed), "--model", model_path, *FLAGS,
                "--ray", "--replicas", "2"]
        assert main(argv) == 0
    finally:
        ray.shutdown()
    assert sorted(distributed.read_text().splitlines()) == sorted(local.read_text().splitlines())
