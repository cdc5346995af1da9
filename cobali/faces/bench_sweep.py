"""`cobali bench serve --sweep RATES`: at each rate the servers in turn (and in turn within every repeat), then
each one's capacity search, the table, and one plot per metric against rate with a line per server."""

from __future__ import annotations

import argparse
import asyncio
import itertools
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cobali.config.flags import flags_record
from cobali.harness import plots
from cobali.harness.latency import write_json
from cobali.harness.serve_client import ServeOptions, run_serve
from cobali.harness.sweep import (
    CAPACITY_METRICS,
    GOODPUT_METRICS,
    CapacitySearch,
    combine_repeats,
    meets,
    parse_limits,
    parse_rates,
    sweep_row,
)
from cobali.harness.workloads import WorkItem

DEFAULT_SLO = "ttft_p99:5000,tpot_p99:150"
# (summary key, plot and column label)
PLOTTED = (("ttft_p50_ms", "TTFT p50 (ms)"), ("ttft_p99_ms", "TTFT p99 (ms)"), ("tpot_p50_ms", "TPOT p50 (ms)"),
           ("tpot_p99_ms", "TPOT p99 (ms)"), ("itl_p99_ms", "ITL p99 (ms)"), ("wall_s", "wall (s)"),
           ("output_tok_s", "output tok/s"), ("goodput_req_s", "goodput (req/s)"))


def add_sweep_args(serve: argparse.ArgumentParser) -> None:
    # dest differs from `cobali bench --sweep` (an engine grid) so the two never overwrite each other.
    serve.add_argument("--sweep", dest="rate_sweep", default=None, metavar="R1,R2,...",
                       help="Poisson request rates (req/s) to run the workload at; the servers take turns at each")
    serve.add_argument("--goodput", default=None, metavar="ttft:MS,tpot:MS",
                       help="report goodput: completed req/s within every limit (vllm bench serve's "
                            f"definition; names: {', '.join(GOODPUT_METRICS)})")
    serve.add_argument("--slo", default=DEFAULT_SLO, metavar="ttft_p99:MS,tpot_p99:MS",
                       help=f"capacity: the highest rate whose run holds these p99s (default {DEFAULT_SLO})")
    serve.add_argument("--repeat", type=int, default=1,
                       help="runs per rate, run k with arrivals from --seed + k (the same for every server); the table "
                            "shows their medians and each one's noise (±half-spread)")
    serve.add_argument("--capacity-steps", type=int, default=2,
                       help="bisections between the highest passing and lowest failing rate (default 2)")


def serve_options(args: argparse.Namespace, url: str, concurrency: int, rate: float, seed: int) -> ServeOptions:
    return ServeOptions(url=url, concurrency=concurrency, request_rate=rate, burstiness=args.burstiness,
                        seed=seed, max_new=args.max_new, model=args.served_model, api_key=args.api_key)


def sweep_settings(args: argparse.Namespace) -> tuple[tuple[float, ...], dict | None, dict]:
    """Every sweep flag checked before any server is contacted."""
    if args.capacity_steps < 0:
        raise ValueError(f"--capacity-steps must be >= 0, got {args.capacity_steps}")
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    limits = parse_limits(args.goodput, GOODPUT_METRICS, "--goodput") if args.goodput else None
    return parse_rates(args.rate_sweep), limits, parse_limits(args.slo, CAPACITY_METRICS, "--slo")


def sweep_command(args: argparse.Namespace, items: list[WorkItem], servers: list[tuple[str, str]],
                  draw: bool = True) -> int:
    """draw: whether to write the plots with the JSON (False where matplotlib is missing)."""
    rates, limits, slo = sweep_settings(args)
    print(f"cobali bench serve --sweep: {len(items)} prompts at {', '.join(f'{r:g}' for r in rates)} req/s "
          f"against {', '.join(name for name, _ in servers)}")
    run_ids = itertools.count()
    rows: dict[str, list[dict]] = {name: [] for name, _ in servers}
    searches = {name: CapacitySearch() for name, _ in servers}

    def measure(points: list[tuple[str, str, float]]) -> None:
        """Each (server, url, rate) args.repeat times, the servers in turn within every repeat: the machine's
        drift over a sweep (minutes-long slow spells) then falls on all of them alike. Repeat k draws its
        arrivals from seed --seed + k, the same for every server: near saturation one arrival pattern can move
        a p50 far (docs/results.md, "Under Poisson load"), so repeats sample patterns while each pattern still
        meets every server."""
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in points}
        for repeat in range(args.repeat):
            for name, url, rate in points:
                options = serve_options(args, url, args.concurrency or len(items), rate, args.seed + repeat)
                result = asyncio.run(run_serve(tagged(items, next(run_ids)), options))
                runs[name].append({**sweep_row(rate, result, limits), "seed": options.seed})
        for name, _, rate in points:
            rows[name].append(combine_repeats(runs[name]))
            searches[name].record(rate, meets(rows[name][-1], slo))

    for rate in rates:
        measure([(name, url, rate) for name, url in servers])
    for _ in range(args.capacity_steps):
        points = [(name, url, mid) for name, url in servers if (mid := searches[name].midpoint()) is not None]
        if not points:
            break
        measure(points)
    capacities = {name: search.capacity() for name, search in searches.items()}
    for name, capacity in capacities.items():
        print(f"{name}: capacity {capacity.describe()}")
    results: dict[str, dict[str, Any]] = {
        name: {"rows": sorted(rows[name], key=lambda r: r["rate"]), "capacity": asdict(capacities[name])}
        for name in rows}
    print(format_sweep(results, slo))
    if args.out:
        out = Path(args.out)
        write_json(out / "sweep.json", {"args": flags_record(args), "slo_ms": slo, "goodput_ms": limits,
                                        "servers": results})
        series = {name: r["rows"] for name, r in results.items()}
        for key, label in PLOTTED if draw else ():
            if any(row.get(key) is not None for rows in series.values() for row in rows):
                plots.metric_vs_rate(out / f"sweep_{key.removesuffix('_ms')}.png", key, label, series)
        print(f"wrote sweep.json{' and one plot per metric' if draw else ''} to {out}")
    failed = sum(row["failed"] for r in results.values() for row in r["rows"])
    return 0 if failed == 0 else 1


def tagged(items: list[WorkItem], run: int) -> list[WorkItem]:
    """The workload with every text prompt opened by a tag of its run. A sweep sends the same prompts many
    times; without the tag a server would answer later runs from the KV an earlier run left cached
    (llama-server keeps each slot's last prompt), and measure its cache instead of its scheduling."""
    return [WorkItem(f"[run {run}] {item.prompt}", item.max_tokens) if isinstance(item.prompt, str) else item
            for item in items]


def format_sweep(results: dict[str, dict], slo: dict[str, float]) -> str:
    rows = [row for r in results.values() for row in r["rows"]]
    columns = [(key, label) for key, label in PLOTTED if any(key in row for row in rows)]
    header = f"{'server':<16}{'rate':>7}" + "".join(f"{label:>17}" for _, label in columns) + f"{'SLO':>6}"
    lines = [header]
    for name, result in results.items():
        for row in result["rows"]:
            cells = "".join(f"{_cell(row, key):>17}" for key, _ in columns)
            lines.append(f"{name:<16}{row['rate']:>7.3g}{cells}{'ok' if meets(row, slo) else 'miss':>6}")
    return "\n".join(lines)


def _cell(row: dict, key: str) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    noise = row.get("noise", {}).get(key)
    return f"{value:.2f}" if noise is None else f"{value:.1f}±{noise:.0%}"
