"""Routing by the KV against routing by load, in the simulator, from 8 to 64 replicas.

    .venv/bin/python bench/sim/routing.py        # conversations over shared contexts, 8 to 64 replicas
    .venv/bin/python bench/sim/routing.py --workload random --rate-per-replica 5   # no shared prefix: lose nothing
    .venv/bin/python bench/sim/routing.py --replicas 8 --customers-per-replica 0.125 --users 128   # one hot context
    .venv/bin/python bench/sim/routing.py --routers least-busy text kv   # power of two, the text tree, the KV

The conversations are llm-d's test of its prefix scorer (150 customers, 6k-token contexts, 8 pods) scaled down:
per replica, --customers-per-replica customers with a --context-tokens context each, --users each holding
--turns turns (cobali/sim/conversations.py), at --rate-per-replica requests/s; so every replica count sees the
same load per replica. Each replica is the real engine on the simulated device of --profile, with its KV on the
device only (no host tier: --host-cache-mib) as vLLM's pods in llm-d's test. Routers (--routers): least-tokens
(the fewest queued tokens, exact and live: the simulator's default), least-busy (power of two choices on requests
in flight, Ray Serve's default), text (frontend/text_prefix_routing.py: a character-level tree of what was sent
each replica, over a stand-in text of the tokens) and kv (frontend/prefix_routing.py, on digests reported every
--routing-stats-period s, weighed by --router-weights and --router-balance as `cobali serve` takes them). Figures
are in virtual time.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np

from cobali.config.serve_flags import add_kv_router_args
from cobali.engine.costs import load_profile
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.prefix_routing import RoutingConfig
from cobali.frontend.text_prefix_routing import TextRoutingConfig
from cobali.harness.workloads import arrival_offsets
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimSpec, simulate
from cobali.sim.conversations import ConversationShape, conversations
from cobali.sim.routers import PowerOfTwo

ROUTERS = ("least-tokens", "least-busy", "text", "kv")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=["least-tokens", "kv"])
    parser.add_argument("--workload", choices=("conversations", "random"), default="conversations")
    parser.add_argument("--profile", default="h100-llama-8b")
    parser.add_argument("--rate-per-replica", type=float, default=10.0, help="requests/s")
    parser.add_argument("--customers-per-replica", type=float, default=4.0, help="0.125 at 8 replicas: one")
    parser.add_argument("--users", type=int, default=4, help="per customer")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--kv-cells", type=int, default=262144, help="per replica, one unified pool")
    parser.add_argument("--host-cache-mib", type=int, default=0)
    add_kv_router_args(parser)  # kv's settings, as `cobali serve` and `cobali simulate` take them
    parser.add_argument("--imbalance", type=int, default=TextRoutingConfig.imbalance, help="text's balance threshold")
    parser.add_argument("--max-chars", type=int, default=TextRoutingConfig.max_chars, help="text's tree per replica")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def workload(args: argparse.Namespace, replicas: int, n_vocab: int) -> tuple[list[SimItem], list[float]]:
    customers = max(1, round(args.customers_per_replica * replicas))
    shape = ConversationShape(customers, args.users, args.turns, args.context_tokens, args.question_tokens,
                              args.answer_tokens, args.max_tokens, args.rate_per_replica * replicas)
    if args.workload == "conversations":
        return conversations(shape, n_vocab, args.seed)
    # As many requests, each as long as a conversation's mean prompt, sharing nothing.
    rng = np.random.default_rng(args.seed)
    mean_len = args.context_tokens + args.question_tokens + (args.turns - 1) * (args.question_tokens
                                                                                + args.answer_tokens) // 2
    items = [SimItem(rng.integers(1, n_vocab, mean_len).tolist(), args.max_tokens) for _ in range(shape.n_requests)]
    return items, arrival_offsets(len(items), shape.rate, seed=args.seed).tolist()


def row(replicas: int, router: str, spec: SimSpec, items: list[SimItem], arrivals: list[float]) -> str:
    result = simulate(items, arrivals, spec)
    summary = result.summary()
    ttft = [f.timing.ttft_ms for f in result.finished if f is not None and f.timing.ttft_ms is not None]
    p50, p90 = np.percentile(ttft, [50, 90])
    assert summary["unfinished"] == 0 and summary["failed"] == 0, summary
    return (f"{replicas:>8} {router:>13} {summary['requests']:>8} {p50:>9.0f} {p90:>9.0f} "
            f"{summary['requests_per_s']:>8.1f} {summary['output_tok_s']:>9.0f} {summary['prefix_hit_rate']:>7.1%} "
            f"{summary['routed_by_load']:>7} {result.real_s:>7.1f}")


def main() -> None:
    args = parse_args()
    config = EngineConfig(max_slots=args.max_slots, n_batch=args.n_batch, host_cache_mib=args.host_cache_mib,
                          record_ticks=False)
    profile = load_profile(args.profile)
    base = SimSpec(profile, config, n_ctx_seq=args.kv_cells, kv_unified=True, seed=args.seed,
                   chars_per_token=profile.chars_per_token)
    routings = {"least-tokens": None, "least-busy": PowerOfTwo(),
                "text": TextRoutingConfig(imbalance=args.imbalance, max_chars=args.max_chars),
                "kv": RoutingConfig().tuned(args.router_weights, args.router_balance, args.routing_stats_period)}
    n_vocab = SimBackend(base.costs).n_vocab
    print(f"{'replicas':>8} {'router':>13} {'requests':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>8} "
          f"{'out tok/s':>9} {'hit':>7} {'by load':>7} {'sim s':>7}   (TTFT in ms)")
    for replicas in args.replicas:
        items, arrivals = workload(args, replicas, n_vocab)
        spec = replace(base, replicas=replicas)
        for router in args.routers:
            print(row(replicas, router, replace(spec, routing=routings[router]), items, arrivals), flush=True)


if __name__ == "__main__":
    main()
