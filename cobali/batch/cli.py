"""`cobali batch --input prompts.jsonl --output out.jsonl`: offline greedy generation, resumable.

    cobali batch --input prompts.jsonl --output out.jsonl --max-new 128
    cobali batch --input prompts.jsonl --output out.jsonl --ray --replicas 4   # pip install 'cobali[ray]'

Rerunning the same command after a kill skips the ids already in the output. The input runs in shards
of 4 x --max-slots lines, each whole on an engine with nothing cached, so with the same engine flags the
outputs are identical with or without Ray, for any number of workers or threads, and after a resume.
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from cobali.batch.jobs import pending_shards, read_jobs, run_shard
from cobali.options import add_engine_args, build_engine, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("batch", help="offline generation: prompts JSONL in, results JSONL out (resumable)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--input", required=True, help='JSONL: {"id"?, "prompt", "max_tokens"?} a line')
    parser.add_argument("--output", required=True, help="JSONL results, appended; ids already there are skipped")
    parser.add_argument("--max-new", type=positive_int, default=64, help="max new tokens per request")
    parser.add_argument("--ray", action="store_true", help="run on Ray workers, one engine each (optional extra)")
    parser.add_argument("--replicas", type=positive_int, default=1, help="Ray workers (with --ray)")
    parser.set_defaults(func=batch_command)


def batch_command(args: argparse.Namespace) -> int:
    if args.replicas > 1 and not args.ray:
        raise ValueError("--replicas > 1 needs --ray (one process runs one engine)")
    jobs = read_jobs(args.input)
    shards = pending_shards(jobs, args.output, args.max_slots)
    todo = sum(len(shard.wanted) for shard in shards)
    print(f"cobali batch: {len(jobs)} prompts, {len(jobs) - todo} already in {args.output}, {todo} to run")
    if not todo:
        return 0
    with open(args.output, "a", encoding="utf-8") as out, \
            tqdm(total=len(jobs), initial=len(jobs) - todo, unit="req", desc="batch") as bar:
        if args.ray:
            from cobali.ray.batch import run_shards_on_ray  # Ray is an optional extra: imported only here

            written = run_shards_on_ray(args, shards, out, on_done=bar.update)
        else:
            engine = build_engine(args, record_ticks=False)
            try:
                written = sum(run_shard(engine, shard, out, args.max_new, on_done=bar.update) for shard in shards)
            finally:
                engine.backend.close()
    print(f"wrote {written} results to {args.output}")
    return 0
