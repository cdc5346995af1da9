"""`cobali simulate`: a workload through the real scheduler on a simulated device, in virtual time.

    cobali simulate --profile h100-llama-8b --random-input-len 512 --random-output-len 128 \\
        --num-prompts 10000 --request-rate 20 --max-slots 64 --n-batch 2048 --replicas 2
    cobali simulate --profile cpu-2core-smollm2 --prompts mixed_length --request-rate 0.5
    cobali simulate --plan --target-ttft-p99 500 --request-rate 40 --profile h100-llama-8b ...
    cobali simulate --replicas 8 --router kv --routing-stats-period 0.5 ...   (bench/sim/routing.py: by workload)
    cobali simulate --replicas 8 --router text --route-max-chars 400000 ...

Every request generates exactly its max tokens (no model decides when to stop). Backend flags other
than --max-slots, --n-batch, --ctx and --kv-unified (which size the simulated KV as they size
llama.cpp's) are ignored.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from cobali.config.flags import (
    add_engine_args,
    add_load_args,
    add_random_args,
    backend_config,
    engine_config,
    file_items,
    flags_record,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from cobali.config.serve_flags import add_kv_router_args
from cobali.engine.costs import load_profile, resolve_profile
from cobali.engine.policies import MODES
from cobali.frontend.prefix_routing import RoutingConfig
from cobali.frontend.text_prefix_routing import TextRoutingConfig
from cobali.harness.latency import format_summary, write_json
from cobali.harness.workloads import arrival_offsets, random_items
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimResult, SimSpec, simulate
from cobali.sim.host import SharedHost
from cobali.sim.plan import Trial, plan_replicas
from cobali.sim.routers import PowerOfTwo


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("simulate", help="run a workload on a simulated device from a cost profile",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)  # includes --profile (a path or a bundled name: cpu-2core-smollm2, h100-llama-8b)
    add_load_args(parser)
    parser.add_argument("--mode", choices=MODES, default="cont", help="scheduling mode")
    add_random_args(parser)
    parser.add_argument("--chars-per-token", type=positive_float, default=None,
                        help="text prompts: characters per simulated token (default: the profile's, "
                             "measured from the model's tokenizer by calibrate; 4 if it has none)")
    parser.add_argument("--replicas", type=positive_int, default=1, help="independent engines behind --router")
    add_routing_args(parser)
    parser.add_argument("--host-cores", type=positive_float, default=None,
                        help="the replicas share one host of this many CPUs: while several compute, each tick "
                             "slows as they and --host-background outgrow it (default: each replica has CPUs of "
                             "its own, as its --profile was calibrated)")
    parser.add_argument("--host-background", type=non_negative_float, default=0.0,
                        help="CPUs of the shared host that other processes keep busy (Ray, the ingress, clients)")
    parser.add_argument("--host-pace", type=positive_float, default=1.0,
                        help="the shared host's ticks take this many times the profile's even with CPUs to spare "
                             "(a deployment's measured ticks against the simulator's for the same tokens)")
    parser.add_argument("--plan", action="store_true", help="find the fewest replicas meeting --target-ttft-p99")
    parser.add_argument("--target-ttft-p99", type=positive_float, default=None, metavar="MS",
                        help="TTFT p99 target for --plan (ms)")
    parser.add_argument("--max-replicas", type=positive_int, default=1024, help="upper bound for --plan")
    parser.set_defaults(func=simulate_command)


ROUTING = RoutingConfig()  # the defaults
TEXT_ROUTING = TextRoutingConfig()


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", choices=("least-tokens", "least-busy", "text", "kv"), default="least-tokens",
                        help="least-tokens: the replica with the fewest queued tokens; least-busy: of two drawn at "
                             "random, the one with fewer requests in flight (Ray Serve's default); text: an "
                             "approximate prefix tree of the text sent to each replica (frontend/"
                             "text_prefix_routing.py); kv: the replica whose reported prefix cache, queue and KV use "
                             "score best (frontend/prefix_routing.py), tuned by the --router and --route flags")
    add_kv_router_args(parser)  # as `cobali serve` takes them
    parser.add_argument("--route-block-tokens", type=positive_int, default=ROUTING.block_tokens,
                        help="tokens per hashed block of the replicas' digests")
    parser.add_argument("--route-max-blocks", type=positive_int, default=ROUTING.max_blocks,
                        help="block hashes in one replica's digest, the most recently used prefixes first")
    parser.add_argument("--route-match-rate", type=non_negative_float, default=TEXT_ROUTING.match_rate,
                        help="text: the share of a prompt's characters a replica's tree must match to win it")
    parser.add_argument("--route-imbalance", type=non_negative_int, default=TEXT_ROUTING.imbalance,
                        help="text: queues further apart than this many requests route by power of two")
    parser.add_argument("--route-max-chars", type=positive_int, default=TEXT_ROUTING.max_chars,
                        help="text: characters in one replica's tree, the least recently routed evicted")


def routing_config(args: argparse.Namespace) -> RoutingConfig | TextRoutingConfig | PowerOfTwo | None:
    if args.router == "text":
        return TextRoutingConfig(args.route_match_rate, args.route_imbalance, args.route_max_chars)
    if args.router != "kv":
        return PowerOfTwo() if args.router == "least-busy" else None
    routing = RoutingConfig(block_tokens=args.route_block_tokens, max_blocks=args.route_max_blocks)
    return routing.tuned(args.router_weights, args.router_balance, args.routing_stats_period)


def sim_spec(args: argparse.Namespace) -> SimSpec:
    if args.async_scheduling:
        raise ValueError("--async-scheduling: the simulator's virtual clock runs one tick at a time; "
                         "simulate without it")
    if args.num_speculative_tokens:
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens}: the simulator's tokens are no "
                         "language, so it would price guessed rows that are never kept; simulate without it")
    llama = backend_config(args)  # the simulated KV is sized as llama.cpp's would be
    n_ctx = llama.total_cells()
    n_ctx_seq = n_ctx if llama.kv_unified else n_ctx // llama.n_seq_max
    config = engine_config(args, mode=args.mode, record_ticks=False)
    profile = load_profile(args.profile)
    return SimSpec(profile, config, n_ctx_seq, llama.kv_unified, args.replicas,
                   chars_per_token=args.chars_per_token or profile.chars_per_token, routing=routing_config(args),
                   seed=args.seed, host=shared_host(args))


def shared_host(args: argparse.Namespace) -> SharedHost | None:
    if args.host_cores is None:
        for flag, value, default in (("--host-background", args.host_background, 0.0),
                                     ("--host-pace", args.host_pace, 1.0)):
            if value != default:
                raise ValueError(f"{flag} {value:g} needs --host-cores")
        return None
    # --threads 0 takes every core of the host, as llama.cpp's default does
    return SharedHost(args.host_cores, args.host_background, args.threads or max(1, int(args.host_cores)),
                      args.host_pace)


def sim_workload(args: argparse.Namespace, spec: SimSpec) -> tuple[list[SimItem], np.ndarray]:
    items = file_items(args)
    tokenizer = SimBackend(spec.costs, chars_per_token=spec.chars_per_token)
    if items is None:
        items = random_items(args.num_prompts or 100, args.random_input_len, args.random_output_len or args.max_new,
                             args.random_range_ratio, tokenizer.n_vocab, args.seed)
    work = [SimItem(tokenizer.tokenize(i.prompt), i.max_tokens or args.max_new, text=i.prompt)
            if isinstance(i.prompt, str) else SimItem(list(i.prompt), i.max_tokens or args.max_new) for i in items]
    return work, arrival_offsets(len(work), args.request_rate, args.burstiness, args.seed)


def simulate_command(args: argparse.Namespace) -> int:
    spec = sim_spec(args)
    items, arrivals = sim_workload(args, spec)
    rate = f"{args.request_rate:g} req/s" if np.isfinite(args.request_rate) else "all at once"
    print(f"cobali simulate: {len(items)} prompts, {rate}, profile {resolve_profile(args.profile).stem} "
          f"({spec.costs.device})")
    if args.plan:
        return plan_command(args, spec, items, arrivals)
    result = simulate(items, arrivals.tolist(), spec)
    report(args, result, f"{spec.replicas} replica(s), {spec.config.max_slots} slots each, router {args.router}")
    return 0


def plan_command(args: argparse.Namespace, spec: SimSpec, items: list[SimItem], arrivals: np.ndarray) -> int:
    if args.target_ttft_p99 is None:
        raise ValueError("--plan needs --target-ttft-p99 MS")
    target = args.target_ttft_p99
    print(f"{'replicas':>8} {'TTFT p99 ms':>12} {'meets':>6} {'sim s':>7}")

    def show(t: Trial) -> None:
        p99 = f"{t.ttft_p99_ms:.1f}" if t.ttft_p99_ms is not None else "> target"
        print(f"{t.replicas:>8} {p99:>12} {'yes' if t.meets(target) else 'no':>6} {t.real_s:>7.2f}")

    best, trials = plan_replicas(items, arrivals.tolist(), spec, target, args.max_replicas, on_trial=show)
    print(f"fewest replicas with TTFT p99 <= {target:g} ms: {best.replicas} "
          f"({len(trials)} trials, {sum(t.real_s for t in trials):.1f} s)")
    report(args, best.result, f"plan: {best.replicas} replica(s), {spec.config.max_slots} slots each")
    return 0


def report(args: argparse.Namespace, result: SimResult, title: str) -> None:
    summary = result.summary()
    print(title)
    print(format_summary(summary))
    print(f"virtual time above; simulated in {summary['sim_real_s']:.2f} s real "
          f"({summary['ticks'] / max(summary['sim_real_s'], 1e-9):,.0f} ticks/s), "
          f"device busy {summary['busy_share']:.1%}")
    if args.out:
        path = write_json(Path(args.out) / "summary.json", {"args": flags_record(args), "summary": summary})
        print(f"wrote {path}")
