"""`cobali bench` (engine configs compared in-process, sweeps, open-loop arrivals) and `cobali bench serve`
(the same metrics measured against an HTTP server)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

from cobali.backends.base import Backend
from cobali.bench import fidelity_cli, plots
from cobali.bench.metrics import latency_samples
from cobali.bench.offline import BenchConfig, LoadOptions, parse_configs, run_configs, sweep_configs
from cobali.bench.report import (
    add_speedups,
    format_gaps,
    format_table,
    run_summary,
    write_json,
    write_offline_files,
)
from cobali.bench.serve_client import ServeOptions, run_serve
from cobali.bench.trace import write_trace
from cobali.bench.workload import arrival_offsets, load_items, random_items
from cobali.options import (
    add_engine_args,
    build_backend,
    engine_config,
    load_costs,
    non_negative_int,
    positive_float,
    positive_int,
)
from cobali.workloads import WorkItem

DEFAULT_CONFIGS = "seq,static,cont"


def add_load_args(parser: argparse.ArgumentParser, prompts_required: bool = False) -> None:
    parser.add_argument("--prompts", required=prompts_required,
                        help="prompts file (.txt/.jsonl/.json) or a scenario name (e.g. mixed_length)")
    parser.add_argument("--num-prompts", type=positive_int, default=None,
                        help="use the first N prompts of the file; the count of random prompts (default 100)")
    parser.add_argument("--max-new", type=positive_int, default=64, help="max new tokens per request")
    parser.add_argument("--request-rate", type=positive_float, default=float("inf"),
                        help="open-loop arrivals per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=positive_float, default=1.0,
                        help="gamma shape of inter-arrival times; 1 = Poisson, < 1 burstier")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed for arrivals and random prompts")
    parser.add_argument("--out", default=None, help="directory for summary.json, request records and plots")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="compare engine configs on a workload; `bench serve`: HTTP")
    add_engine_args(parser)
    add_load_args(parser)
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated: seq, static, cont, cont-splitN (default {DEFAULT_CONFIGS})")
    parser.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2,...",
                        help="cont-mode grid over max-slots and/or prefill-chunk-tokens (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max-new tokens")
    parser.add_argument("--trace", default=None, help="write a Chrome Trace Event JSON (opens in Perfetto)")
    parser.add_argument("--random-input-len", type=positive_int, default=None, help="random token prompts")
    parser.add_argument("--random-output-len", type=positive_int, default=None,
                        help="max new tokens of random prompts (default --max-new)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random lengths uniform in [len*(1-r), len*(1+r)]")
    parser.set_defaults(func=bench_command)
    nested = parser.add_subparsers(dest="bench_command", metavar="{serve,fidelity}")
    serve = nested.add_parser("serve", help="stream a workload against an OpenAI-compatible /v1/completions")
    serve.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    add_load_args(serve, prompts_required=True)
    serve.add_argument("--concurrency", type=positive_int, default=1, help="most requests in flight")
    # dest differs from the engine's --model (a GGUF path) so the two never overwrite each other.
    serve.add_argument("--model", dest="served_model", default=None,
                       help="model name to send (default: the first one the server lists)")
    serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    serve.set_defaults(func=serve_command)
    fidelity_cli.register(nested)


def bench_configs(args: argparse.Namespace) -> list[BenchConfig]:
    if args.sweep and args.configs:
        raise ValueError("--sweep and --configs are exclusive: a sweep runs its grid in cont mode")
    if args.sweep:
        return sweep_configs(args.sweep, args.max_slots, args.prefill_chunk_tokens)
    return parse_configs(args.configs or DEFAULT_CONFIGS, args.max_slots, args.prefill_chunk_tokens)


def file_items(args: argparse.Namespace) -> list[WorkItem] | None:
    """The prompts file's items, or None for a random workload (drawn once the vocabulary is known)."""
    if args.random_input_len is None:
        if args.prompts is None:
            raise ValueError("give --prompts FILE|SCENARIO or --random-input-len N")
        return load_items(args.prompts, args.num_prompts)
    if args.prompts is not None:
        raise ValueError("--prompts and --random-input-len are exclusive")
    return None


def load_options(args: argparse.Namespace, n_items: int) -> LoadOptions:
    offsets = arrival_offsets(n_items, args.request_rate, args.burstiness, args.seed)
    return LoadOptions(args.max_new, args.ignore_eos, args.request_rate, tuple(offsets.tolist()))


def shared_backend(args: argparse.Namespace, configs: list[BenchConfig]) -> Backend:
    """One model load for every config: as many sequences as the largest config uses."""
    n_slots = max(c.max_slots for c in configs)
    return build_backend(argparse.Namespace(**{**vars(args), "max_slots": n_slots}))


def bench_command(args: argparse.Namespace, backend: Backend | None = None) -> int:
    configs = bench_configs(args)
    items = file_items(args)
    backend = backend or shared_backend(args, configs)
    try:
        if items is None:
            items = random_items(args.num_prompts or 100, args.random_input_len,
                                 args.random_output_len or args.max_new, args.random_range_ratio,
                                 backend.info.n_vocab, args.seed)
        print(f"cobali bench: {len(items)} prompts, configs {', '.join(c.name for c in configs)}, "
              f"{backend.info.description}")
        runs = run_configs(backend, configs, items, engine_config(args), load_options(args, len(items)),
                           costs=load_costs(args, backend))
        info = asdict(backend.info)
    finally:
        backend.close()
    summaries = add_speedups([run_summary(r) for r in runs])
    print(format_table(summaries))
    print(format_gaps(summaries))
    if args.out:
        out = Path(args.out)
        meta = {"args": _args_dict(args), "backend": info, "prompts": len(items)}
        written = write_offline_files(out, meta, runs, summaries)
        written += plots.write_offline_plots(out, runs, summaries)
        print(f"wrote {len(written)} files to {out}")
    if args.trace:
        print(f"wrote {write_trace(args.trace, runs)}")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    items = load_items(args.prompts, args.num_prompts)
    options = ServeOptions(url=args.url, concurrency=args.concurrency, request_rate=args.request_rate,
                           burstiness=args.burstiness, seed=args.seed, max_new=args.max_new,
                           model=args.served_model, api_key=args.api_key)
    print(f"cobali bench serve: {len(items)} prompts against {args.url}, concurrency {args.concurrency}")
    result = asyncio.run(run_serve(items, options))
    summary = add_speedups([{"config": urlsplit(args.url).netloc or args.url, **result.summary()}])
    print(format_table(summary))
    errors = [r.error for r in result.records if r.error]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    if args.out:
        out = Path(args.out)
        write_json(out / "summary.json", {"args": _args_dict(args), "runs": summary})
        write_json(out / "requests.json", [r.as_dict() for r in result.records])
        samples = {summary[0]["config"]: latency_samples(r.timing() for r in result.records)}
        plots.throughput_bars(out / "throughput.png", summary)
        plots.latency_cdfs(out / "latency_cdf.png", samples)
        print(f"wrote summary.json, requests.json and plots to {out}")
    return 0 if len(errors) < len(result.records) else 1


def _args_dict(args: argparse.Namespace) -> dict:
    # JSON has no Infinity: the default request rate is written as the string "inf".
    return {k: "inf" if v == float("inf") else v for k, v in vars(args).items() if k != "func"}
