"""`cobali batch --input prompts.jsonl --output out.jsonl`: offline greedy generation, resumable.

    cobali batch --input prompts.jsonl --output out.jsonl --max-new 128
    cobali batch --input prompts.jsonl --output out.jsonl --ray --replicas 4   # pip install 'cobali[ray]'

Rerunning the same command after a kill skips the ids already in the output. The input runs in shards
of 4 x --max-slots lines, each whole on an engine with nothing cached, so with the same engine flags the
outputs are identical with or without Ray, for any number of workers or threads, and after a resume.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from cobali.batch.jobs import Shard, pending_shards, read_jobs, run_shard
from cobali.config.flags import add_engine_args, engine_setup, positive_int
from cobali.engine.setup import EngineSetup
from cobali.harness.results_file import ResultsFile

# (spec, max_new, shards, output, on_done) -> results written; Ray's runner comes from cobali.faces.cli.
ShardsRunner = Callable[[EngineSetup, int, Sequence[Shard], IO[str], Callable[[], None] | None], int]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("batch", help="offline generation: prompts JSONL in, results JSONL out (resumable)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--input", required=True, help='JSONL: {"id"?, "prompt", "max_tokens"?} a line')
    parser.add_argument("--output", required=True, help="JSONL results, appended; ids already there are skipped")
    parser.add_argument("--max-new", type=positive_int, default=64, help="max new tokens per request")
    parser.add_argument("--ray", action="store_true", help="run on Ray workers, one engine each (optional extra)")
    parser.add_argument("--replicas", type=positive_int, default=1, help="Ray workers (with --ray)")
    parser.set_defaults(func=batch_command)
    return parser


def run_shards_here(spec: EngineSetup, max_new: int, shards: Sequence[Shard], out: IO[str],
                    on_done: Callable[[], None] | None = None) -> int:
    engine = spec.build_engine()
    try:
        return sum(run_shard(engine, shard, out, max_new, on_done=on_done) for shard in shards)
    finally:
        engine.close()


def batch_command(args: argparse.Namespace, run_shards: ShardsRunner = run_shards_here) -> int:
    if args.replicas > 1 and not args.ray:
        raise ValueError("--replicas > 1 needs --ray (one process runs one engine)")
    spec = engine_setup(args, record_ticks=False)
    jobs = read_jobs(args.input)
    shards = pending_shards(jobs, args.output, args.max_slots)
    todo = sum(len(shard.wanted) for shard in shards)
    ResultsFile(Path(args.output)).append("batch", "prompts", len(jobs), todo,
                                          lambda out, on_done: run_shards(spec, args.max_new, shards, out, on_done))
    return 0
