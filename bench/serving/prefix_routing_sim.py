"""bench/serving/prefix_routing.py --sim: its request list through the simulator, so that a real run and the
simulator can be compared on the same requests.

Each chat is rendered by the model's template and tokenized as the server does it, each token id then folded into
the simulated vocabulary (the simulator's ids are few; equal prompts stay equal, and two that differ differ again in
about one token of its size after the first difference); its arrival time is the real run's offset. The engine's
settings come from the same flags as the server's (--serve-flags, parsed as `cobali simulate` parses them: flags it
does not know are named and ignored), at --replicas; the device's costs from --profile (calibrate one with the
server's --threads: `cobali calibrate --threads 1 --out FILE`). Routers: least-busy (power of two on requests in
flight), text (the prefix tree, on the rendered prompt) and kv (the digests of what each replica holds), as `cobali
simulate --router` runs them with their default settings.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from prefix_workload import ChatRequest

from cobali.faces import simulate as face
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, SimResult, simulate

if TYPE_CHECKING:
    from prefix_routing import TextSide


def sim_args(args: argparse.Namespace, router: str, seed: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cobali")
    face.register(parser.add_subparsers())
    argv = ["simulate", "--profile", args.profile, "--replicas", str(args.replicas), "--threads", str(args.threads),
            *shlex.split(args.serve_flags), *shlex.split(args.sim_flags), "--router", router, "--seed", str(seed)]
    known, unknown = parser.parse_known_args(argv)
    if unknown:
        print(f"the simulator ignores {' '.join(unknown)}")
    return known


def summary(run: SimResult) -> dict:
    from prefix_routing import first_seen_order

    result = run.summary()
    by_index = [f.timing.ttft_ms if f is not None else None for f in run.finished]
    ttft = [t for t in by_index if t is not None]
    return {"requests": result["requests"] + result["unfinished"], "lost": result["unfinished"] + result["failed"],
            "prefix_hit_rate": result["prefix_hit_rate"], "ttft_mean_ms": float(np.mean(ttft)) if ttft else None,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p90_ms": float(np.percentile(ttft, 90)) if ttft else None,
            "requests_per_s": result["requests_per_s"], "output_tok_s": result["output_tok_s"],
            "wall_s": result["wall_s"], "sim_real_s": result["sim_real_s"], "ttft_ms": by_index,
            "ticks": result["ticks"], "tick_s": result["busy_share"] * result["wall_s"] * result["replicas"],
            "batch_tokens": round(result["mean_batch_tokens"] * result["ticks"]),
            "replica": first_seen_order([None if p is None else str(p) for p in run.placements])}


def simulate_chats(args: argparse.Namespace, text: TextSide, requests: Sequence[ChatRequest],
                   offsets: Sequence[float], seed: int) -> dict[str, dict]:
    from prefix_routing import HEADER, row

    specs = {router: face.sim_spec(sim_args(args, router, seed)) for router in args.routers}
    fold = min(SimBackend(spec.costs).n_vocab for spec in specs.values()) - 1  # ids in [1, n_vocab): 0 ends it
    items = []
    for request in requests:
        prompt = text.render(request.messages)
        tokens = [1 + token % fold for token in text.tokens(prompt)]
        items.append(SimItem(tokens, request.max_tokens, request.session, prompt))
    print(f"simulated: {args.replicas} replicas, profile {args.profile}; prompts of "
          f"{min(len(i.tokens) for i in items)}-{max(len(i.tokens) for i in items)} tokens")
    print(HEADER, flush=True)
    summaries = {}
    for router in args.routers:
        result = simulate(items, list(offsets), specs[router])
        summaries[router] = summary(result)
        print(row(router, summaries[router]), flush=True)
    return summaries


COMPARED = ("prefix_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "ttft_mean_ms", "requests_per_s", "tick_s")


def print_comparison(real: dict[str, dict], simulated: dict[str, dict]) -> None:
    """Simulated over real, for each router run both ways (pooled over the seeds, then each seed where both ran
    the same ones): the issue's bar is 15 %. Then the CPUs the real runs' host spent besides the engines' ticks,
    for the simulator's --host-background."""
    print(f"simulated / real: {'router':>10} " + " ".join(f"{name:>14}" for name in COMPARED))
    for router in (r for r in simulated if r in real):
        pairs = [(router, simulated[router], real[router])]
        seeds_sim, seeds_real = simulated[router].get("seeds", []), real[router].get("seeds", [])
        if len(seeds_sim) == len(seeds_real):
            pairs += [(f"seed #{i}", a, b) for i, (a, b) in enumerate(zip(seeds_sim, seeds_real, strict=True))]
        for label, sim, run in pairs:
            ratios = [f"{sim[k] / run[k]:>14.2f}" if sim.get(k) is not None and run.get(k) else f"{'-':>14}"
                      for k in COMPARED]
            print(f"{'':>18}{label:>10} " + " ".join(ratios))
    measured = {router: run["host_background"] for router, run in real.items() if run.get("host_background")}
    if measured:
        print("the real runs' host background, CPUs: " + ", ".join(f"{r} {b:.2f}" for r, b in measured.items())
              + f"; mean {np.mean(list(measured.values())):.2f} (--host-background)")
    # Where both computed the same tokens, their tick seconds differ only by how fast the ticks ran.
    paces = {router: real[router]["tick_s"] / sim["tick_s"] for router, sim in simulated.items()
             if router in real and sim["tick_s"] > 0
             and abs(real[router]["batch_tokens"] / sim["batch_tokens"] - 1) < 0.01}
    if paces:
        print("real ÷ simulated tick seconds, for the same tokens: "
              + ", ".join(f"{r} {p:.3f}" for r, p in paces.items())
              + " (times the simulator's --host-pace: what the shared host's CPUs do not explain)")
