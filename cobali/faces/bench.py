"""`cobali bench` (engine configs compared in-process, sweeps, open-loop arrivals) and `cobali bench serve`
(the same metrics measured against an HTTP server)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

from cobali.config.flags import (
    add_engine_args,
    add_load_args,
    add_random_args,
    backend_config,
    engine_setup,
    file_items,
    flags_record,
    positive_int,
)
from cobali.engine.setup import build_backend
from cobali.faces import bench_fidelity, bench_sweep
from cobali.harness import plots
from cobali.harness.configs import BenchConfig, parse_configs, run_configs, sweep_configs
from cobali.harness.driver import LoadOptions
from cobali.harness.latency import latency_samples, write_json
from cobali.harness.report import (
    add_speedups,
    format_gaps,
    format_table,
    run_summary,
    write_offline_files,
)
from cobali.harness.serve_client import endpoints, run_serve
from cobali.harness.trace import write_trace
from cobali.harness.workloads import arrival_offsets, load_items, random_items

DEFAULT_CONFIGS = "seq,static,cont"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="compare engine configs on a workload; `bench serve`: HTTP")
    add_engine_args(parser)
    add_load_args(parser)
    parser.add_argument("--configs", default=None,
                        help="comma-separated: seq, static, cont, cont-splitN; any ending in -async runs with "
                             f"async scheduling (default {DEFAULT_CONFIGS})")
    parser.add_argument("--sweep", action="append", default=[], metavar="KNOB=V1,V2,...",
                        help="cont-mode grid over max-slots and/or prefill-chunk-tokens (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly max-new tokens")
    parser.add_argument("--trace", default=None, help="write a Chrome Trace Event JSON (opens in Perfetto)")
    add_random_args(parser)
    parser.set_defaults(func=bench_command)
    nested = parser.add_subparsers(dest="bench_command", metavar="{serve,fidelity}")
    serve = nested.add_parser("serve", help="stream a workload against an OpenAI-compatible /v1/completions")
    serve.add_argument("--url", required=True, action="append", metavar="[NAME=]URL",
                       help="server root, e.g. http://127.0.0.1:8000; repeat to measure several in turn")
    add_load_args(serve, prompts_required=True)
    serve.add_argument("--concurrency", type=positive_int, default=None,
                       help="most requests in flight (default 1; with --sweep, unbounded: open loop)")
    # dest differs from the engine's --model (a GGUF path) so the two never overwrite each other.
    serve.add_argument("--model", dest="served_model", default=None,
                       help="model name to send (default: the first one the server lists)")
    serve.add_argument("--api-key", default=None, help="sent as a Bearer token")
    bench_sweep.add_sweep_args(serve)
    serve.set_defaults(func=serve_command)
    bench_fidelity.register(nested)


def bench_configs(args: argparse.Namespace) -> list[BenchConfig]:
    if args.sweep and args.configs:
        raise ValueError("--sweep and --configs are exclusive: a sweep runs its grid in cont mode")
    if args.sweep:
        return sweep_configs(args.sweep, args.max_slots, args.prefill_chunk_tokens)
    return parse_configs(args.configs or DEFAULT_CONFIGS, args.max_slots, args.prefill_chunk_tokens)


def load_options(args: argparse.Namespace, n_items: int) -> LoadOptions:
    offsets = arrival_offsets(n_items, args.request_rate, args.burstiness, args.seed)
    return LoadOptions(args.max_new, args.ignore_eos, args.request_rate, tuple(offsets.tolist()))


def bench_command(args: argparse.Namespace) -> int:
    configs = bench_configs(args)
    items = file_items(args)
    draw = bool(args.out) and plots.can_plot("cobali bench")
    spec = engine_setup(args)
    # One model load for every config: as many sequences as the largest config uses.
    backend = build_backend(backend_config(args, n_seq_max=max(c.max_slots for c in configs)))
    try:
        if items is None:
            items = random_items(args.num_prompts or 100, args.random_input_len,
                                 args.random_output_len or args.max_new, args.random_range_ratio,
                                 backend.info.n_vocab, args.seed)
        print(f"cobali bench: {len(items)} prompts, configs {', '.join(c.name for c in configs)}, "
              f"{backend.info.description}")
        runs = run_configs(backend, configs, items, spec.engine, load_options(args, len(items)),
                           costs=spec.load_costs(backend))
        info = asdict(backend.info)
    finally:
        backend.close()
    summaries = add_speedups([run_summary(r) for r in runs])
    print(format_table(summaries))
    print(format_gaps(summaries))
    if args.out:
        out = Path(args.out)
        meta = {"args": flags_record(args), "backend": info, "prompts": len(items)}
        written = write_offline_files(out, meta, runs, summaries)
        if draw:
            written += plots.write_offline_plots(out, runs, summaries)
        print(f"wrote {len(written)} files to {out}")
    if args.trace:
        print(f"wrote {write_trace(args.trace, runs)}")
    return 0


def server_urls(specs: list[str]) -> list[tuple[str, str]]:
    """--url values as (name, url): 'llama=http://h:1' is named llama; a bare URL by its host:port."""
    servers = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = urlsplit(spec).netloc or spec, spec
        endpoints(url)  # a bad URL fails here, before any request
        servers.append((name, url))
    if len({name for name, _ in servers}) < len(servers):
        raise ValueError(f"--url: two servers share a name in {specs}; name them NAME=URL")
    return servers


def serve_command(args: argparse.Namespace) -> int:
    items = load_items(args.prompts, args.num_prompts)
    servers = server_urls(args.url)
    draw = bool(args.out) and plots.can_plot("cobali bench serve")
    if args.rate_sweep is not None:
        return bench_sweep.sweep_command(args, items, servers, draw)
    concurrency = args.concurrency or 1
    summaries, samples, records, errors = [], {}, {}, []
    for name, url in servers:
        options = bench_sweep.serve_options(args, url, concurrency, args.request_rate, args.seed)
        print(f"cobali bench serve: {len(items)} prompts against {url}, concurrency {concurrency}")
        result = asyncio.run(run_serve(items, options))
        summaries.append({"config": name, **result.summary()})
        samples[name] = latency_samples(r.timing() for r in result.records)
        records[name] = [r.as_dict() for r in result.records]
        errors += [r.error for r in result.records if r.error]
    summary = add_speedups(summaries)
    print(format_table(summary))
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}")
    if args.out:
        out = Path(args.out)
        write_json(out / "summary.json", {"args": flags_record(args), "runs": summary})
        # One server: its records (the file's format before --url could repeat); several: by server name.
        write_json(out / "requests.json", records[servers[0][0]] if len(servers) == 1 else records)
        if draw:
            plots.throughput_bars(out / "throughput.png", summary)
            plots.latency_cdfs(out / "latency_cdf.png", samples)
        print(f"wrote summary.json, requests.json{' and plots' if draw else ''} to {out}")
    return 0 if len(errors) < len(items) * len(servers) else 1
