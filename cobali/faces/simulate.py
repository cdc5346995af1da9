"""`cobali simulate`: a workload through the real scheduler on a simulated device, in virtual time.

    cobali simulate --profile h100-llama-8b --random-input-len 512 --random-output-len 128 \\
        --num-prompts 10000 --request-rate 20 --max-slots 64 --n-batch 2048 --replicas 2
    cobali simulate --profile cpu-2core-smollm2 --prompts mixed_length --request-rate 0.5
    cobali simulate --plan --target-ttft-p99 500 --request-rate 40 --profile h100-llama-8b ...

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
    positive_float,
    positive_int,
)
from cobali.engine.costs import load_profile, resolve_profile
from cobali.engine.policies import MODES
from cobali.harness.latency import format_summary, write_json
from cobali.harness.workloads import arrival_offsets, random_items
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimResult, SimSpec, simulate
from cobali.sim.plan import Trial, plan_replicas


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
    parser.add_argument("--replicas", type=positive_int, default=1,
                        help="independent engines behind a fewest-queued-tokens router")
    parser.add_argument("--plan", action="store_true", help="find the fewest replicas meeting --target-ttft-p99")
    parser.add_argument("--target-ttft-p99", type=positive_float, default=None, metavar="MS",
                        help="TTFT p99 target for --plan (ms)")
    parser.add_argument("--max-replicas", type=positive_int, default=1024, help="upper bound for --plan")
    parser.set_defaults(func=simulate_command)


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
                   chars_per_token=args.chars_per_token or profile.chars_per_token)


def sim_workload(args: argparse.Namespace, spec: SimSpec) -> tuple[list[SimItem], np.ndarray]:
    items = file_items(args)
    tokenizer = SimBackend(spec.costs, chars_per_token=spec.chars_per_token)
    if items is None:
        items = random_items(args.num_prompts or 100, args.random_input_len, args.random_output_len or args.max_new,
                             args.random_range_ratio, tokenizer.n_vocab, args.seed)
    work = [SimItem(tokenizer.tokenize(i.prompt) if isinstance(i.prompt, str) else list(i.prompt),
                    i.max_tokens or args.max_new) for i in items]
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
    report(args, result, f"{spec.replicas} replica(s), {spec.config.max_slots} slots each")
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
