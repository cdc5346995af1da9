"""One stream at a time: each server's TTFT and TPOT at idle, the servers taking turns round by round.

    .venv/bin/python bench/serving/idle_stream.py --url llama-server=http://127.0.0.1:8091 \
        --url cobali=http://127.0.0.1:8092 [--url cobali-si16=http://127.0.0.1:8093] --rounds 6

Every request is the same prompt (the first line of --prompts, default workloads/prompts_16.txt) with
--max-tokens tokens (ignore_eos, greedy), sent alone: after the first request each server holds its KV, so
the TTFT is one token's prefill and the time until the server streams it. Each round sends --requests
requests to every server in turn, the order reversed every other round (drift on this VM is slow but not
zero). A round's figure per server is its median over the requests; each ratio is to the first --url, taken
round by round, then summarised by its median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from cobali.config.flags import positive_int
from cobali.harness.serve_client import ServeOptions, endpoints, run_serve
from cobali.harness.workloads import WorkItem

METRICS = ("tpot_p50_ms", "ttft_p50_ms")


def named_url(spec: str) -> tuple[str, str]:
    name, sep, url = spec.partition("=")
    return (name, url) if sep else (spec, spec)


def measure(url: str, items: list[WorkItem]) -> dict:
    result = asyncio.run(run_serve(items, ServeOptions(url=url, concurrency=1), progress=False))
    summary = result.summary()
    if summary["failed"]:
        raise SystemExit(f"{url}: {summary['failed']} requests failed: {result.records[0].error}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", required=True, help="[NAME=]URL, repeat; ratios are to the first")
    parser.add_argument("--prompts", default="workloads/prompts_16.txt", help="its first line is the prompt")
    parser.add_argument("--rounds", type=positive_int, default=6)
    parser.add_argument("--requests", type=positive_int, default=6, help="per server per round")
    parser.add_argument("--max-tokens", type=positive_int, default=200)
    args = parser.parse_args()
    lines = Path(args.prompts).read_text().splitlines()
    if not lines or not lines[0].strip():
        raise SystemExit(f"--prompts {args.prompts}: no prompt on its first line")
    items = [WorkItem(lines[0], args.max_tokens)] * args.requests
    servers = [named_url(spec) for spec in args.url]
    for _, url in servers:
        try:
            endpoints(url)
        except ValueError as err:
            parser.error(str(err))
    for _, url in servers:  # warm-up: each server caches the prompt's KV
        measure(url, items[:1])
    ratios: dict[str, dict[str, list[float]]] = {name: {m: [] for m in METRICS} for name, _ in servers[1:]}
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        figures = {name: measure(url, items) for name, url in order}
        base = figures[servers[0][0]]
        cells = []
        for name, _ in servers:
            row = figures[name]
            cells.append(f"{name} TPOT {row['tpot_p50_ms']:.3f} ms TTFT {row['ttft_p50_ms']:.1f} ms")
            if name in ratios:
                for metric in METRICS:
                    ratios[name][metric].append(row[metric] / base[metric])
        print(f"round {round_ + 1}: " + " | ".join(cells), flush=True)
    for name, by_metric in ratios.items():
        parts = [f"{metric.split('_')[0].upper()} p50 median {statistics.median(r):.3f}x "
                 f"(range {min(r):.3f}-{max(r):.3f})" for metric, r in by_metric.items()]
        print(f"{name} / {servers[0][0]} over {args.rounds} rounds: " + ", ".join(parts))


if __name__ == "__main__":
    main()
