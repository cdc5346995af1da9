"""`cobali batch --ray --replicas N`: one engine per Ray actor, shards of jobs handed out as actors free
up, results written by the driver process as each shard comes back (so resuming works per shard)."""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Sequence
from typing import IO

import ray
from ray.util import ActorPool

from cobali.batch.jobs import Shard, run_shard
from cobali.options import build_engine


@ray.remote
class BatchWorker:
    def __init__(self, flags: dict) -> None:
        args = argparse.Namespace(**flags)
        self.max_new = args.max_new
        self.engine = build_engine(args, record_ticks=False)

    def run(self, shard: Shard) -> list[str]:
        out = io.StringIO()
        run_shard(self.engine, shard, out, self.max_new)
        return out.getvalue().splitlines()


def run_shards_on_ray(args: argparse.Namespace, shards: Sequence[Shard], out: IO[str],
                      on_done: Callable[[], None] | None = None) -> int:
    if not ray.is_initialized():
        # A local cluster unless RAY_ADDRESS points at one; each actor claims one CPU.
        ray.init(include_dashboard=False, log_to_driver=False)
    flags = {k: v for k, v in vars(args).items() if k != "func"}
    pool = ActorPool([BatchWorker.remote(flags) for _ in range(args.replicas)])
    written = 0
    for lines in pool.map_unordered(lambda worker, shard: worker.run.remote(shard), shards):
        out.write("".join(line + "\n" for line in lines))
        out.flush()
        written += len(lines)
        for _ in lines:
            if on_done is not None:
                on_done()
    return written
