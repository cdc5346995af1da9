"""`cobali batch --ray --replicas N`: a Ray Data pipeline over the input's shards, mapped by a pool of N
actors that own one engine each; the driver writes each shard's results as it comes back, so a kill
loses at most the shards in flight and a rerun resumes."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from typing import IO

import numpy as np
import ray
import ray.data

from cobali.batch.jobs import Job, Shard, run_shard
from cobali.engine.setup import EngineSetup


def shard_to_json(shard: Shard) -> str:
    return json.dumps({"jobs": [[j.id, j.prompt, j.max_tokens] for j in shard.jobs], "wanted": list(shard.wanted)})


def shard_from_json(text: str) -> Shard:
    data = json.loads(text)
    return Shard(tuple(Job(*job) for job in data["jobs"]), frozenset(data["wanted"]))


class ShardRunner:
    """One engine per actor; each call runs a batch of shards and returns their JSONL results."""

    def __init__(self, spec: EngineSetup, max_new: int) -> None:
        self.max_new = max_new
        self.engine = spec.build_engine()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        results = []
        for text in batch["shard"]:
            out = io.StringIO()
            run_shard(self.engine, shard_from_json(str(text)), out, self.max_new)
            results.append(out.getvalue())
        return {"lines": results}


def run_shards_on_ray(replicas: int, spec: EngineSetup, max_new: int, shards: Sequence[Shard], out: IO[str],
                      on_done: Callable[[], None] | None = None) -> int:
    if not ray.is_initialized():
        # A local cluster unless RAY_ADDRESS points at one.
        ray.init(include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = False  # write shards as they finish
    dataset = ray.data.from_items([{"shard": shard_to_json(s)} for s in shards], override_num_blocks=len(shards))
    results = dataset.map_batches(ShardRunner, fn_constructor_kwargs={"spec": spec, "max_new": max_new},
                                  batch_size=1, concurrency=replicas, num_cpus=max(1, spec.backend.n_threads))
    written = 0
    for row in results.iter_rows():
        lines = row["lines"].splitlines()
        out.write("".join(line + "\n" for line in lines))
        out.flush()
        written += len(lines)
        for _ in lines:
            if on_done is not None:
                on_done()
    return written
