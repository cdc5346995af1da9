"""`cobali run`: one workload through one engine configuration, with metrics."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from cobali.config.flags import add_engine_args, engine_setup, positive_int
from cobali.engine.policies import MODES
from cobali.harness.driver import LoadOptions, run_workload
from cobali.harness.latency import format_summary, request_record
from cobali.harness.workloads import load_workload


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("run", help="run a prompts file through the engine and report metrics")
    add_engine_args(parser)
    parser.add_argument("--prompts", required=True, help=".txt (a prompt a line), .jsonl or a JSON scenario")
    parser.add_argument("--mode", choices=MODES, default="cont", help="scheduling mode")
    parser.add_argument("--max-new", type=positive_int, default=64, help="max new tokens per request")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max-new tokens")
    parser.add_argument("--json", dest="json_out", default=None, help="write config, summary and requests here")
    parser.add_argument("--trace-steps", action="store_true", help="print every tick's batch composition")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    items = load_workload(args.prompts)
    engine = engine_setup(args, mode=args.mode).build_engine()
    print(f"cobali run: {len(items)} prompts, mode {args.mode}, {engine.backend_info.description}")
    result = run_workload(engine, items, LoadOptions(args.max_new, args.ignore_eos), trace_steps=args.trace_steps)
    summary = result.summary()
    print(format_summary(summary))
    if (stats := engine.stats()).draft_tokens:
        summary |= {"draft_tokens": stats.draft_tokens, "accepted_draft_tokens": stats.accepted_draft_tokens}
        print(f"speculative decoding: {stats.accepted_draft_tokens} of {stats.draft_tokens} guessed tokens kept")
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        config["backend"] = asdict(engine.backend_info)
        out = {"config": config, "summary": summary, "requests": [request_record(o) for o in result.outputs]}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}")
    return 0
