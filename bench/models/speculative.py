"""Speculative decoding by prompt lookup on the real model: what a guessed row costs, and what guessing gives.

    .venv/bin/python bench/models/speculative.py --prompts results/held_out.json --num-prompts 24 --k 0,2,3 --rounds 3

1. Row costs: one sequence at --position, a decode of 1, 2, ... K+1 rows (a decode row and K guesses), the
   median of --repeat decodes each. A guess pays when it is kept often enough to save what a decode costs.
2. Runs: the workload's first --num-prompts requests through one engine of --slots slots (guessing in ticks
   with at most --max-batch decoding requests), greedy with
   ignore_eos, once per K in --k (0: no speculation), in turn for --rounds rounds (the VM drifts: compare
   within a round). Prints wall, TPOT p50 and the share of guesses kept.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cobali.backends.base import WANT_LOGITS
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.speculative import SpecConfig
from cobali.frontend.offline import LLM
from cobali.harness.workloads import load_items


def row_costs(backend: LlamaCppBackend, position: int, max_rows: int, repeat: int) -> list[float]:
    """Median ms of a decode of n rows of sequence 0 after `position` tokens, for n = 1..max_rows."""
    prompt = (backend.tokenize("The quick brown fox jumps over the lazy dog. " * (position // 8 + 1)))[:position]
    backend.remove_seq(0)
    decode(backend, prompt, 0, last_only=True)
    costs = []
    for n in range(1, max_rows + 1):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            decode(backend, [42] * n, position)
            times.append(time.perf_counter() - start)
            backend.remove_seq(0, position, -1)
        costs.append(statistics.median(times) * 1e3)
    backend.remove_seq(0)
    return costs


def decode(backend: LlamaCppBackend, tokens: list[int], start: int, last_only: bool = False) -> None:
    n = len(tokens)
    want = np.full(n, 0 if last_only else WANT_LOGITS, dtype=np.int8)
    want[-1] = WANT_LOGITS
    backend.decode(np.array(tokens, dtype=np.int32), np.arange(start, start + n, dtype=np.int32),
                   np.zeros(n, dtype=np.int32), want)


def run(backend: LlamaCppBackend, items: list, slots: int, k: int, max_batch: int, max_new: int) -> dict:
    engine = Engine(backend, EngineConfig(max_slots=slots, spec=SpecConfig(k, max_batch=max_batch),
                                          prefix_cache=False))
    start = time.perf_counter()
    requests = [engine.add_request(item.prompt, SamplingParams(max_tokens=item.max_tokens or max_new, ignore_eos=True))
                for item in items]
    list(LLM(engine).run())
    wall = time.perf_counter() - start
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in requests
            if len(r.token_times) > 1]
    stats = engine.stats()
    kept = stats.accepted_draft_tokens / stats.draft_tokens if stats.draft_tokens else None
    return {"k": k, "wall_s": wall, "tpot_p50_ms": statistics.median(tpot) * 1e3, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="workloads/mixed_length.json")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--k", default="0,2,3", help="speculative tokens per run, comma-separated (0: none)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=1, help="guess only in ticks with at most this many "
                        "decoding requests (--speculative-max-batch)")
    parser.add_argument("--max-new", type=int, default=64, help="new tokens of a request the workload gives none")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--position", type=int, default=300, help="row costs: tokens already in the sequence")
    parser.add_argument("--repeat", type=int, default=40, help="row costs: decodes per row count")
    args = parser.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    items = load_items(args.prompts)[: args.num_prompts]
    backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=args.slots, n_threads=args.threads))
    try:
        costs = row_costs(backend, args.position, max(ks) + 1, args.repeat)
        print(f"rows  ms per decode (one sequence at position {args.position})")
        for n, ms in enumerate(costs, 1):
            print(f"{n:>4}  {ms:6.2f}")
        print(f"{'round':>5} {'K':>3} {'wall s':>8} {'TPOT p50 ms':>12} {'kept':>6}")
        for round_ in range(1, args.rounds + 1):
            for k in ks:
                r = run(backend, items, args.slots, k, args.max_batch, args.max_new)
                kept = f"{r['kept']:.0%}" if r["kept"] is not None else "-"
                print(f"{round_:>5} {k:>3} {r['wall_s']:>8.2f} {r['tpot_p50_ms']:>12.2f} {kept:>6}", flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
