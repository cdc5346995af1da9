"""Routing by the prefix cache on real replicas: a shared-prefix chat workload against a server, by router.

    .venv/bin/python bench/serving/prefix_routing.py --url http://127.0.0.1:8000     # a server already up
    .venv/bin/python bench/serving/prefix_routing.py --launch --routers least-busy text kv   # one after another
    .venv/bin/python bench/serving/prefix_routing.py --sim --profile PROFILE    # the same requests, simulated
    .venv/bin/python bench/serving/prefix_routing.py --sim --compare real.json  # ... and set beside a real run
    .venv/bin/python bench/serving/prefix_routing.py --launch --seeds 0 1 2 --out real.json   # pooled over 3

The workload (prefix_workload.py): --customers system prompts of about --context-tokens tokens each, --users per
customer each holding --turns turns of short questions, Poisson arrivals at --rate, --max-tokens per reply
(ignore_eos: every reply is that long), streamed chat completions with an x-session-id per user. --launch starts
`cobali serve --replicas 2 --threads 1 --router R` (and --serve-flags) for each router, runs the workload, stops it;
--url runs it once against a server already up. Reported per run: the prefix hit rate (the servers' own counters:
cobali:prefix_cache_hits_total over cobali:prefix_cache_queries_total, over the run), TTFT p50 and p90 (from
sending to the first streamed token), requests/s and output tokens/s (from the first send to the last reply's
end) and requests lost (an error, or a reply short of --max-tokens). The JSON (--out) also holds each request's
TTFT in the list's order, and the replicas' ticks, their seconds and the tokens they carried (the servers'
tick_duration_seconds and iteration_tokens), to set a real run beside the simulator's request by request and tick
by tick, and the replicas' own mean TTFT (from a request's arrival at the engine), against the client's mean: the
front door's share.

--seeds runs a workload for each seed in turn (a fresh server for each, under --launch) and pools them: TTFT
percentiles over all their requests, the rest averaged or summed; each seed's own summary is kept in the JSON.

--sim runs the same request list (the chats rendered and tokenized by --model's own template and tokenizer, at
the same arrival times) through the simulator at --replicas with --profile's costs, under the same --serve-flags,
for each router: prefix_routing_sim.py. Figures there are in virtual time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import numpy as np
from prefix_workload import ChatRequest, ChatShape, chat_requests
from proc_tree import tree_cpu_s
from soak import started_server

from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary
from cobali.config.flags import positive_float, positive_int
from cobali.frontend.chat_template import ChatPrompter
from cobali.harness.serve_client import ClientRecord, stream_one

ROUTERS = ("least-busy", "text", "kv")
HITS, QUERIES = "cobali:prefix_cache_hits_total", "cobali:prefix_cache_queries_total"
# Read at the start and the end of a run: the run's share is the difference.
COUNTERS = (HITS, QUERIES, "cobali:tick_duration_seconds_count", "cobali:tick_duration_seconds_sum",
            "cobali:iteration_tokens_sum", "cobali:time_to_first_token_seconds_sum",
            "cobali:time_to_first_token_seconds_count")
HEADER = f"{'router':>10} {'requests':>8} {'lost':>5} {'hit':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>7} " \
         f"{'out tok/s':>9} {'bg CPUs':>7}   (TTFT in ms; bg: what the host spent besides the ticks)"


class TextSide:
    """A model's chat template and tokenizer, read without its weights: to size the contexts in tokens, and to
    give the simulator each request's tokens and text as the server makes them."""

    def __init__(self, model: str | None) -> None:
        self.vocab = LlamaCppVocabulary.load(LlamaCppConfig(model_path=model))
        self.prompter = ChatPrompter(self.vocab.chat_template_source(), self.vocab.apply_chat_template)

    def count(self, text: str) -> int:
        return len(self.vocab.tokenize(text, add_special=False))

    def render(self, messages: list[dict[str, str]]) -> str:
        return self.prompter.prompt(messages)

    def tokens(self, text: str) -> list[int]:
        return self.vocab.tokenize(text)


def counter_sum(page: str, name: str) -> float:
    """The sum of a counter's samples over its labels (one per replica, or none) in a Prometheus text page."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def run_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    page = (await client.get(f"{url}/metrics")).text
    return {name: counter_sum(page, name) for name in COUNTERS}


async def run_chats(url: str, requests: Sequence[ChatRequest], offsets: Sequence[float],
                    timeout_s: float = 1800, server_pid: int | None = None) -> dict:
    """Send each request at its offset; the summary of what came back. Given the server's process, also the
    CPUs that the host spent besides the engines' ticks (the server's processes and this client, less the ticks'
    seconds): what `cobali simulate --host-background` takes."""
    cpu0 = (tree_cpu_s(server_pid), time.process_time()) if server_pid is not None else None
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        before = await run_counters(client, url)
        wall0 = time.perf_counter()

        async def one(index: int, request: ChatRequest) -> ClientRecord:
            await asyncio.sleep(max(0.0, wall0 + offsets[index] - time.perf_counter()))
            body = {"messages": request.messages, "max_tokens": request.max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0.0, "stream_options": {"include_usage": True}}
            return await stream_one(client, f"{url}/v1/chat/completions", body, ClientRecord(index),
                                    headers={"x-session-id": request.session})

        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        after = await run_counters(client, url)
        wall = time.perf_counter() - wall0
    ran = {name: after[name] - before[name] for name in COUNTERS}
    spent = None if cpu0 is None or server_pid is None else \
        tree_cpu_s(server_pid) - cpu0[0] + time.process_time() - cpu0[1]
    summary = summarize(records, wall0, ran[HITS] / ran[QUERIES] if ran[QUERIES] > 0 else 0.0,
                        requests[0].max_tokens if requests else 0)
    engine_ttfts = ran["cobali:time_to_first_token_seconds_count"]
    summary.update(ticks=int(ran["cobali:tick_duration_seconds_count"]), tick_s=ran["cobali:tick_duration_seconds_sum"],
                   batch_tokens=int(ran["cobali:iteration_tokens_sum"]),
                   # From the engine's arrival: set beside the client's mean, the front door's share.
                   engine_ttft_mean_ms=ran["cobali:time_to_first_token_seconds_sum"] / engine_ttfts * 1e3
                   if engine_ttfts else None,
                   host_background=None if spent is None else (spent - ran["cobali:tick_duration_seconds_sum"]) / wall)
    return summary


def summarize(records: Sequence[ClientRecord], wall0: float, hit_rate: float, max_tokens: int) -> dict:
    done = [r for r in records if r.error is None and r.output_tokens == max_tokens and r.chunk_times]
    ttft = [(r.chunk_times[0] - r.start) * 1e3 for r in done]
    by_index = {r.index: (r.chunk_times[0] - r.start) * 1e3 for r in done}
    end = max((r.end for r in done if r.end is not None), default=wall0)
    wall = max(end - wall0, 1e-9)
    errors = sorted({r.error for r in records if r.error is not None})
    return {"requests": len(records), "lost": len(records) - len(done), "prefix_hit_rate": hit_rate,
            "ttft_mean_ms": float(np.mean(ttft)) if ttft else None,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft else None,
            "requests_per_s": len(done) / wall, "output_tok_s": sum(r.output_tokens for r in done) / wall,
            "wall_s": wall, "errors": errors[:5], "ttft_ms": [by_index.get(i) for i in range(len(records))],
            "replica": first_seen_order([r.served_by for r in sorted(records, key=lambda r: r.index)])}


def first_seen_order(names: Sequence[str | None]) -> list[int | None]:
    """Each request's replica, numbered in the order the replicas first answered: a real run's and the
    simulator's placements compare directly."""
    numbers: dict[str, int] = {}
    return [None if name is None else numbers.setdefault(name, len(numbers)) for name in names]


def row(router: str, s: dict) -> str:
    p50, p90 = (f"{s[k]:>9.0f}" if s[k] is not None else f"{'-':>9}" for k in ("ttft_p50_ms", "ttft_p90_ms"))
    return (f"{router:>10} {s['requests']:>8} {s['lost']:>5} {s['prefix_hit_rate']:>7.1%} {p50} {p90} "
            f"{s['requests_per_s']:>7.2f} {s['output_tok_s']:>9.1f} "
            + (f"{s['host_background']:>7.2f}" if s.get("host_background") is not None else f"{'-':>7}"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a server already up: one run, labelled --label")
    where.add_argument("--launch", action="store_true", help="start `cobali serve` for each of --routers in turn")
    where.add_argument("--sim", action="store_true", help="the simulator instead (prefix_routing_sim.py)")
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    parser.add_argument("--label", default="server", help="--url: the run's name in the table")
    parser.add_argument("--replicas", type=positive_int, default=2)
    parser.add_argument("--threads", type=positive_int, default=1, help="per replica")
    parser.add_argument("--serve-flags", default="", help="more `cobali serve` flags (--launch, and --sim's engine)")
    parser.add_argument("--startup-s", type=positive_float, default=300, help="--launch: wait for /health this long")
    parser.add_argument("--model", default=None, help="GGUF whose template and tokenizer size and render the chats "
                                                      "(default: the embedded model, as the server's)")
    parser.add_argument("--sim-flags", default="",
                        help="--sim: more `cobali simulate` flags, e.g. --host-cores 2 --host-background 0.3")
    parser.add_argument("--profile", default="cpu-1thread-smollm2",
                        help="--sim: the cost profile (default: this project's VM on one thread, as a replica runs)")
    shape = ChatShape()
    parser.add_argument("--customers", type=positive_int, default=shape.customers)
    parser.add_argument("--users", type=positive_int, default=shape.users, help="per customer")
    parser.add_argument("--turns", type=positive_int, default=shape.turns, help="per user")
    parser.add_argument("--context-tokens", type=positive_int, default=shape.context_tokens)
    parser.add_argument("--question-words", type=positive_int, default=shape.question_words)
    parser.add_argument("--answer-words", type=int, default=shape.answer_words)
    parser.add_argument("--max-tokens", type=positive_int, default=shape.max_tokens)
    parser.add_argument("--rate", type=positive_float, default=shape.rate, help="requests/s, Poisson")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="one workload each (its contexts, questions and arrivals); with several, the TTFT "
                             "percentiles are over all their requests")
    parser.add_argument("--out", type=Path, default=None, help="write the summaries here as JSON")
    parser.add_argument("--compare", type=Path, default=None,
                        help="--sim: a real run's --out, to print simulated / real for each router run both ways")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    text = TextSide(args.model)
    shape = ChatShape(args.customers, args.users, args.turns, args.context_tokens, args.question_words,
                      args.answer_words, args.max_tokens, args.rate)
    by_seed = [run_seed(args, text, shape, seed) for seed in args.seeds]
    summaries = {router: pooled([runs[router] for runs in by_seed]) for router in by_seed[0]}
    if len(args.seeds) > 1:
        print(f"pooled over seeds {' '.join(map(str, args.seeds))}:\n{HEADER}")
        for router, summary in summaries.items():
            print(row(router, summary))
    if args.sim and args.compare is not None:
        from prefix_routing_sim import print_comparison

        print_comparison(json.loads(args.compare.read_text())["runs"], summaries)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": summaries},
                                       indent=1))
        print(f"wrote {args.out}")
    return 1 if any(s["lost"] for s in summaries.values()) else 0


def run_seed(args: argparse.Namespace, text: TextSide, shape: ChatShape, seed: int) -> dict[str, dict]:
    """Each router's summary of one seed's workload: real servers (a fresh one per router) or the simulator."""
    requests, offsets = chat_requests(shape, text.count, seed)
    sizes = [text.count(r.messages[0]["content"]) for r in requests]
    print(f"seed {seed}: {len(requests)} requests, {shape.customers} contexts of {min(sizes)}-{max(sizes)} tokens, "
          f"{args.rate:g} req/s, {args.max_tokens} tokens out")
    if args.sim:
        from prefix_routing_sim import simulate_chats  # the simulator's imports only when asked

        return simulate_chats(args, text, requests, offsets, seed)
    summaries = {}
    print(HEADER, flush=True)
    for router in args.routers if args.launch else [args.label]:
        if args.launch:
            flags = ["--replicas", str(args.replicas), "--threads", str(args.threads), "--router", router,
                     *shlex.split(args.serve_flags)]
            with started_server(flags, args.startup_s) as (url, server):
                summaries[router] = asyncio.run(run_chats(url, requests, offsets, server_pid=server.pid))
        else:
            summaries[router] = asyncio.run(run_chats(args.url.rstrip("/"), requests, offsets))
        print(row(router, summaries[router]), flush=True)
    return summaries


def pooled(runs: Sequence[dict]) -> dict:
    """One router's runs over several seeds as one: its TTFT percentiles over all their requests (p90 of one
    64-request run is one order statistic in a sparse tail), rates and hit rates averaged, counts summed. A single
    run is returned as it is; the runs stay under "seeds"."""
    if len(runs) == 1:
        return runs[0]
    ttft = [t for run in runs for t in run["ttft_ms"] if t is not None]
    summed = {key: sum(run[key] for run in runs) for key in ("requests", "lost", "ticks", "tick_s", "batch_tokens")}
    means = {key: float(np.mean([run[key] for run in runs]))
             for key in ("prefix_hit_rate", "requests_per_s", "output_tok_s", "wall_s", "host_background")
             if all(run.get(key) is not None for run in runs)}
    return {**summed, **means, "ttft_mean_ms": float(np.mean(ttft)) if ttft else None,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft else None, "seeds": list(runs)}


if __name__ == "__main__":
    raise SystemExit(main())
