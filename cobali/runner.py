"""`cobali run`: one workload through one engine configuration, with metrics."""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cobali.bench.metrics import request_timing, summarize
from cobali.engine.engine import Engine, TickRecord
from cobali.engine.request import Request
from cobali.engine.sampling import SamplingParams
from cobali.options import add_engine_args, build_engine, positive_int
from cobali.workloads import WorkItem, load_workload

MODES = ("seq", "static", "cont")


@dataclass
class RunResult:
    requests: list[Request]
    wall_s: float
    user_cpu_s: float
    ticks: list[TickRecord]

    def summary(self) -> dict:
        return {**summarize(self.requests, self.wall_s, self.user_cpu_s), **tick_stats(self.ticks)}


def tick_stats(ticks: Sequence[TickRecord]) -> dict:
    """Scheduler-side figures: ticks, batch sizes, wasted slots, and host time around llama_decode."""
    if not ticks:
        return {"ticks": 0}
    tick_s = np.array([t.end - t.start for t in ticks])
    host_s = np.array([t.host_s for t in ticks])
    return {
        "ticks": len(ticks),
        "mean_batch_tokens": float(np.mean([t.plan.n_tokens for t in ticks])),
        "wasted_decode_slots": int(sum(t.plan.wasted_slots for t in ticks)),
        "host_ms_per_tick": float(host_s.mean() * 1e3),
        "host_share": float(host_s.sum() / tick_s.sum()),
    }


def user_cpu_seconds() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def run_workload(
    engine: Engine,
    items: Sequence[WorkItem],
    max_new: int,
    ignore_eos: bool = False,
    progress: str | None = "requests",
    trace_steps: bool = False,
) -> RunResult:
    """Submit every item at once (offline), run to completion, return requests in workload order."""
    start_ticks = len(engine.ticks)
    cpu0, wall0 = user_cpu_seconds(), time.perf_counter()
    requests = [
        engine.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens or max_new, ignore_eos=ignore_eos),
                      arrival_time=wall0)
        for item in items
    ]
    bar = tqdm(total=len(requests), desc=progress, unit="req", leave=False, disable=progress is None)
    if trace_steps:
        engine.on_tick = lambda t: bar.write(
            f"tick {t.plan.tick}: {t.plan.describe()}, {(t.end - t.start) * 1e3:.1f} ms")
    try:
        engine.run_until_done(on_finish=lambda _r: bar.update())
    finally:
        engine.on_tick = None
        bar.close()
    wall = time.perf_counter() - wall0
    return RunResult(requests, wall, user_cpu_seconds() - cpu0, engine.ticks[start_ticks:])


def request_record(request: Request) -> dict:
    timing = request_timing(request)
    return {
        "id": request.id,
        "prompt_tokens": len(request.prompt_tokens),
        "output_tokens": len(request.output_tokens),
        "text": request.text,
        "finish_reason": request.finish_reason.value if request.finish_reason else None,
        "error": request.error,
        "ttft_ms": timing.ttft_ms,
        "tpot_ms": timing.tpot_ms,
        "e2el_ms": timing.e2el_ms,
        "queue_ms": timing.queue_ms,
        "itl_ms": list(timing.itl_ms),
    }


def format_summary(summary: dict) -> str:
    lines = [
        f"requests            {summary['requests']} ({summary['failed']} failed)",
        f"prompt tokens       {summary['prompt_tokens']}",
        f"generated tokens    {summary['generated_tokens']}",
        f"wall time           {summary['wall_s']:.2f} s",
        f"user CPU time       {summary['user_cpu_s']:.2f} s",
        f"throughput          {summary['requests_per_s']:.2f} req/s, {summary['output_tok_s']:.1f} output tok/s, "
        f"{summary['total_tok_s']:.1f} total tok/s",
    ]
    if summary.get("ticks"):
        lines.append(f"ticks               {summary['ticks']} (mean {summary['mean_batch_tokens']:.1f} tok/batch, "
                     f"host {summary['host_ms_per_tick']:.2f} ms/tick = {summary['host_share']:.1%}, "
                     f"wasted decode slots {summary['wasted_decode_slots']})")
    lines.append(f"{'latency (ms)':<20}{'mean':>10}{'p50':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        cells = [summary[f"{name}_{stat}_ms"] for stat in ("mean", "p50", "p99")]
        lines.append(f"{name.upper():<20}" + "".join(f"{c:>10.1f}" if c is not None else f"{'-':>10}" for c in cells))
    return "\n".join(lines)


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
    engine = build_engine(args, mode=args.mode)
    print(f"cobali run: {len(items)} prompts, mode {args.mode}, {engine.backend.info.description}")
    result = run_workload(engine, items, args.max_new, args.ignore_eos, trace_steps=args.trace_steps)
    summary = result.summary()
    print(format_summary(summary))
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        config["backend"] = asdict(engine.backend.info)
        out = {"config": config, "summary": summary, "requests": [request_record(r) for r in result.requests]}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json_out}")
    return 0
