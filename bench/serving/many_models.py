"""Many models behind one endpoint (issue 48): a cold and a warm model's TTFT, throughput alternating between two
resident models against each served alone, and the memory budget under a load that forces evictions; `cobali
serve --models` against llama-server's router mode on the same model files.

    # a server already up (--pid: its process, whose model processes' RSS is sampled)
    .venv/bin/python bench/serving/many_models.py --url http://127.0.0.1:8310 --server cobali --pid 1234 \\
        --models smollm2-135m qwen-12l qwen-24l --budget-mib 941
    # start one server, or both back to back (same files, slots, context, threads), then stop it
    .venv/bin/python bench/serving/many_models.py --start llama-server [--out DIR]
    .venv/bin/python bench/serving/many_models.py --compare --out results/many_models

Models of a started server: the embedded SmolLM2-135M (94 MiB) and two `cobali synth-model` shapes (~240 and
~335 MiB, written once into ~/.cache/cobali/synth), or --files NAME=PATH ...; A, B and C are the first three.
The budget (--budget-mib; default: the two largest models and half the smallest, each its file and
--overhead-mib for its KV, compute buffers and process: any two fit, three don't) is cobali's --models-memory,
its --models-max the model count; llama-server, which evicts by count, gets the count the budget fits as its
--models-max. cobali's load cap per client is lifted (this one client forces loads on purpose) and its
--models-min-resident is --min-resident (default 0: llama-server has none).

Every request is one short prompt, streamed on /v1/completions by the client of `cobali bench serve` (a chat
template would add a few prompt tokens, nothing else, to what is measured), greedy, ignore_eos with a fixed
--max-tokens (random weights would end at random): every server generates the same tokens' count. Phases:
1. cold TTFT of A, B and C in turn: POST /models/unload for every model, then a request to the model, its TTFT
   holding the load (median of --repeats); warm TTFT: the same request again (median of --repeats).
2. throughput: --clients closed-loop clients each alternating A and B (half start on each), --requests in all;
   then A alone, then B alone. alternating ÷ alone: the alternating tok/s over what the two alone give for the
   same mix (their harmonic mean).
3. memory: --memory-requests cycling A, B, C from --memory-clients clients. Every ~100 ms: the server's own
   count of resident bytes (cobali's GET /models `memory`) and the RSS of its child processes (model files are
   mapped: their pages in RSS count). Loads and evictions: /metrics where it counts them, else model processes
   started and ended. Lost: anything but a 200 stream of all --max-tokens tokens, by status.
A phase an endpoint is missing for is skipped, saying which (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx
from many_models_client import (
    Missing,
    closed_loop,
    lost,
    new_client,
    reported_budget,
    root_url,
    stream,
    unload_all,
    watching,
)
from many_models_servers import (
    LLAMA_SERVER,
    MIB,
    Setup,
    cobali_command,
    default_budget,
    default_files,
    footprints,
    link_models,
    llama_server_command,
    parse_files,
    serving,
)

from cobali.config.flags import positive_int

SERVERS = ("cobali", "llama-server")


async def ttft_ms(client: httpx.AsyncClient, url: str, model: str, max_tokens: int) -> float:
    record = await stream(client, url, model, max_tokens)
    ttft = record.timing().ttft_ms
    if record.error is not None or ttft is None:
        raise RuntimeError(f"a request to {model!r} failed: {record.error or 'no token came back'}")
    return ttft


async def cold_warm(url: str, names: Sequence[str], repeats: int, max_tokens: int) -> dict:
    """Each model's TTFT cold (every model unloaded first) and warm (right after), medians of `repeats`."""
    row: dict = {}
    async with new_client(1) as client, httpx.AsyncClient(base_url=root_url(url), timeout=30) as admin:
        for letter, model in zip("ABC", names, strict=False):
            colds, warms = [], []
            for _ in range(repeats):
                await unload_all(admin, names)
                colds.append(await ttft_ms(client, url, model, max_tokens))
            for _ in range(repeats):
                warms.append(await ttft_ms(client, url, model, max_tokens))
            row |= {f"cold_ttft_ms_{letter}": statistics.median(colds), f"warm_ttft_ms_{letter}":
                    statistics.median(warms), f"cold_ttft_samples_ms_{letter}": colds,
                    f"warm_ttft_samples_ms_{letter}": warms}
    return row


async def throughput(url: str, a: str, b: str, clients: int, requests: int, max_tokens: int,
                     pid: int | None) -> dict:
    per = max(1, requests // clients)
    async with new_client(1) as client:
        for model in (a, b):  # both resident before the clock starts
            await ttft_ms(client, url, model, max_tokens)
    runs = {"alternating": [[(a, b)[(i + j) % 2] for j in range(per)] for i in range(clients)],
            "alone_a": [[a] * per for _ in range(clients)], "alone_b": [[b] * per for _ in range(clients)]}
    row: dict = {"throughput_lost": 0}
    for name, plans in runs.items():
        async with watching(url, pid) as watch:
            result = await closed_loop(url, plans, max_tokens)
        summary = result.summary()
        loads, _, _ = watch.loads_evictions()
        row |= {f"{name}_tok_s": summary["output_tok_s"], f"{name}_req_s": summary["requests_per_s"],
                f"{name}_loads": loads}
        row["throughput_lost"] += sum(lost(result.records, max_tokens).values())
    alone = statistics.harmonic_mean([row["alone_a_tok_s"], row["alone_b_tok_s"]])  # 0 where one made nothing
    row["alternating_vs_alone"] = row["alternating_tok_s"] / alone if alone else None
    return row


async def memory(url: str, names: Sequence[str], clients: int, requests: int, max_tokens: int,
                 pid: int | None) -> dict:
    per = max(1, requests // clients)
    # Client i's j-th request is request i + j * clients of one cycle A, B, C, ...
    plans = [[names[(i + j * clients) % len(names)] for j in range(per)] for i in range(clients)]
    async with watching(url, pid) as watch:
        result = await closed_loop(url, plans, max_tokens)
    summary, reasons = result.summary(), lost(result.records, max_tokens)
    loads, evictions, counted = watch.loads_evictions()
    return {"memory_requests": len(result.records), "lost": sum(reasons.values()), "lost_reasons": dict(reasons),
            "loads": loads, "evictions": evictions, "loads_counted_by": counted,
            "max_reported_mib": None if watch.max_reported_bytes is None else watch.max_reported_bytes / MIB,
            "max_children_rss_mib": None if watch.max_children_rss_bytes is None
            else watch.max_children_rss_bytes / MIB,
            "memory_samples": watch.samples, "e2e_p50_ms": summary["e2el_p50_ms"], "e2e_p99_ms": summary["e2el_p99_ms"]}


def measure(url: str, names: Sequence[str], args: argparse.Namespace, pid: int | None,
            budget_mib: float | None) -> dict:
    """Every phase against one server; a phase that cannot run leaves a note instead of figures."""
    row: dict = {"models": list(names), "budget_mib": asyncio.run(reported_budget(url)) or budget_mib, "notes": []}
    phases = {"cold/warm TTFT": lambda: cold_warm(url, names, args.repeats, args.max_tokens),
              "throughput": lambda: throughput(url, names[0], names[1], args.clients, args.requests,
                                               args.max_tokens, pid),
              "memory": lambda: memory(url, names[:3], args.memory_clients, args.memory_requests, args.max_tokens,
                                       pid)}
    for phase, run in phases.items():
        print(f"  {phase} ...", flush=True)
        try:
            row |= asyncio.run(run())
        except (Missing, RuntimeError, httpx.HTTPError) as err:
            row["notes"].append(f"{phase} skipped: {type(err).__name__}: {err}")
            print(f"  {row['notes'][-1]}", flush=True)
    if row["budget_mib"] and row.get("max_children_rss_mib"):
        row["rss_vs_budget"] = row["max_children_rss_mib"] / row["budget_mib"]
    return row


def started(server: str, setup: Setup, args: argparse.Namespace, scratch: Path, logs: Path) -> dict:
    """Start `server` on the setup's files, measure it, stop it; a server that won't start leaves a note."""
    if server == "llama-server":
        command = llama_server_command(setup, link_models(setup.files, scratch / "models"), args.port)
    else:
        command = cobali_command(setup, args.port)
    print(f"{server}: {' '.join(command)}", flush=True)
    try:
        with serving(server, command, args.port, logs / f"{server}.log") as (url, pid):
            return measure(url, list(setup.files), args, pid, setup.budget_bytes / MIB) | {"command": command}
    except RuntimeError as err:
        print(f"  {server} did not start: {err}", flush=True)
        return {"notes": [f"did not start: {err}"], "command": command}


ROWS = (*((f"{k}_ttft_ms_{m}", f"{k} TTFT ms, {m}") for m in "ABC" for k in ("cold", "warm")),
        ("alternating_tok_s", "tok/s alternating A, B"), ("alone_a_tok_s", "tok/s A alone"),
        ("alone_b_tok_s", "tok/s B alone"), ("alternating_vs_alone", "alternating ÷ alone"),
        ("alternating_req_s", "req/s alternating"), ("alternating_loads", "loads while alternating"),
        ("throughput_lost", "requests lost, throughput runs"), ("budget_mib", "budget MiB"),
        ("max_reported_mib", "max resident MiB (the server's count)"),
        ("max_children_rss_mib", "max RSS of the model processes MiB"), ("rss_vs_budget", "max RSS ÷ budget"),
        ("loads", "loads cycling A, B, C"), ("evictions", "evictions cycling A, B, C"),
        ("lost", "requests lost cycling A, B, C"), ("e2e_p50_ms", "E2E p50 ms cycling"),
        ("e2e_p99_ms", "E2E p99 ms cycling"))


def cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.0f}"
    return "-" if value is None else str(value)


def table(results: dict[str, dict]) -> list[str]:
    """A markdown table, one column per server, and the first server ÷ the second where both measured."""
    names = list(results)
    ratio = f"{names[0]} ÷ {names[1]}" if len(names) == 2 else None
    lines = ["| metric | " + " | ".join(names) + (f" | {ratio} |" if ratio else " |"),
             "|---" * (len(names) + 1 + bool(ratio)) + "|"]
    for key, label in ROWS:
        values = [results[name].get(key) for name in names]
        cells = [cell(v) for v in values]
        if ratio:
            a, b = values
            cells.append(f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b
                         else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, row in results.items():
        if row.get("models"):
            lines.append(f"\n{name}: A, B, C = " + ", ".join(row["models"][:3]))
        if row.get("lost_reasons"):
            lines.append(f"\n{name} lost: " + ", ".join(f"{n} x {why}" for why, n in row["lost_reasons"].items()))
        if "loads_counted_by" in row:
            lines.append(f"\n{name}: loads and evictions counted by {row['loads_counted_by']}")
        lines += [f"\n{name}: {note}" for note in row.get("notes", ())]
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a server already running: its root, e.g. http://127.0.0.1:8310")
    where.add_argument("--start", choices=SERVERS, help="start this server on the model files, then stop it")
    where.add_argument("--compare", action="store_true", help="start both servers back to back; ratios")
    parser.add_argument("--server", default="server", help="--url's label in the report (cobali, llama-server)")
    parser.add_argument("--models", nargs="+", help="--url: the models' names, A B C (a third forces evictions)")
    parser.add_argument("--pid", type=int, help="--url: the server's pid, to sample its model processes' RSS")
    parser.add_argument("--files", nargs="+", metavar="NAME=PATH", help="started servers' models (default: the "
                        "embedded model and two synth shapes)")
    parser.add_argument("--budget-mib", type=positive_int, help="default: room for the two largest models and "
                        "half the smallest, each its file and --overhead-mib")
    parser.add_argument("--overhead-mib", type=positive_int, default=128, help="a model process's memory besides "
                        "its file, in the default budget and llama-server's --models-max")
    parser.add_argument("--slots", type=positive_int, default=4, help="per model")
    parser.add_argument("--ctx", type=positive_int, default=2048, help="KV cells per model, all slots")
    # Two models busy at once with all the cores each: llama.cpp's spinning thread pools then fight (on 2 cores,
    # llama-server alternating at -t 2 made 0.09x the tokens/s of each alone; at -t 1, 1.0x).
    parser.add_argument("--threads", type=positive_int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="per model (default: half the cores)")
    parser.add_argument("--min-resident", default="0", help="cobali's --models-min-resident (seconds)")
    parser.add_argument("--llama-server", default=str(LLAMA_SERVER), help="(bench/tools/build_llama_tools.sh)")
    parser.add_argument("--port", type=int, default=8310, help="for a started server")
    parser.add_argument("--max-tokens", type=positive_int, default=32)
    parser.add_argument("--repeats", type=positive_int, default=3, help="cold and warm TTFT requests each")
    parser.add_argument("--clients", type=positive_int, default=4, help="throughput phase")
    parser.add_argument("--requests", type=positive_int, default=24, help="throughput phase, per run")
    parser.add_argument("--memory-clients", type=positive_int, default=2)
    parser.add_argument("--memory-requests", type=positive_int, default=24)
    parser.add_argument("--out", help="write many_models.json and many_models.md here")
    args = parser.parse_args(argv)
    if args.url and not args.models:
        parser.error("--url needs --models A B C")
    if (args.compare or args.start == "llama-server") and not os.access(args.llama_server, os.X_OK):
        parser.error(f"no llama-server at {args.llama_server}: build it with bench/tools/build_llama_tools.sh")
    return args


def run(args: argparse.Namespace) -> dict[str, dict]:
    files = parse_files(args.files) if args.files else {}
    if len(args.models or files or "ABC") < 3:
        raise ValueError("three models are needed: A, B and a third that forces evictions")
    if args.url:
        return {args.server: measure(args.url, args.models, args, args.pid, args.budget_mib)}
    files = files or default_files()
    overhead = args.overhead_mib * MIB
    budget = args.budget_mib * MIB if args.budget_mib else default_budget(footprints(files, overhead))
    setup = Setup(files, budget, overhead, args.slots, args.ctx, args.threads, args.min_resident, args.llama_server)
    print("models: " + ", ".join(f"{name} {os.path.getsize(path) / MIB:.0f} MiB" for name, path in files.items())
          + f"; budget {budget / MIB:.0f} MiB", flush=True)
    with tempfile.TemporaryDirectory(prefix="many_models_") as tmp:
        logs = Path(args.out or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        return {server: started(server, setup, args, Path(tmp), logs)
                for server in (SERVERS if args.compare else (args.start,))}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = table(results)
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "many_models.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
        (out / "many_models.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {out}/many_models.json and many_models.md")
    return 1 if any(row.get("notes") for row in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
