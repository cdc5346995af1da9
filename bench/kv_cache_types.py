"""KV cache types on one model: bytes per token, decode speed, and greedy fidelity against f16.

    .venv/bin/python bench/kv_cache_types.py [--types f16,q8_0,q4_0] [--max-slots 16] [--prompt-tokens 512]
        [--gen-tokens 64] [--repeat 3] [--fidelity-prompts workloads/prompts_16.txt] [--fidelity-max-new 64]

K and V take the same type (--cache-type-k/-v). Bytes per token: the KV buffer llama.cpp allocates, per cell
(from the size it logs), and what one saved token takes (llama_state_seq_get_size over a sequence's tokens).
Decode: every slot gets a prompt of --prompt-tokens, then all decode --gen-tokens tokens together; only ticks that
are pure decode count (as bench/decode_throughput.py), median of --repeat runs, the types taking turns in each.
Fidelity: the same engine configuration run greedily with f16 and with each type, compared request by request at
the first divergence by the f16 run's logit margin there (cobali/bench/fidelity.py): under the epsilon is a
near-tie, over it a change the quantized cache made to a clear choice. f16 runs twice: the control.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import replace

import numpy as np

from cobali.backends.base import SamplingParams
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.tools import llama_logs
from cobali.bench.fidelity import compare_runs, greedy_traces
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.options import add_backend_args, backend_config, positive_int
from cobali.workloads import load_items

# llama.cpp's line on the KV buffer it made: "llama_kv_cache: size = 90.00 MiB (2048 cells, 30 layers, 2/2 seqs)"
KV_LINE = r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,.*?(\d+)/\d+ seqs"


def typed(args: argparse.Namespace, cache_type: str, n_ctx: int = 0):
    return replace(backend_config(args), cache_type_k=cache_type, cache_type_v=cache_type, n_ctx=n_ctx)


def kv_bytes(args: argparse.Namespace, cache_type: str) -> dict:
    """Bytes a cell takes in llama.cpp's KV buffer (its own log), and per token of a saved sequence."""
    logs = llama_logs()
    mark = logs.count
    backend = LlamaCppBackend(typed(args, cache_type, n_ctx=4096))
    try:
        said = "\n".join(text for _, text in logs.since(mark))
        mib, cells, seqs = re.search(KV_LINE, said).groups()
        n = 256
        tokens = np.array([1000 + j for j in range(n)], dtype=np.int32)
        backend.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int8))
        saved = backend.save_seq(0).nbytes
    finally:
        backend.close()
    return {"buffer_per_cell": float(mib) * 2**20 / (int(cells) * int(seqs)), "saved_per_token": saved / n,
            "estimate_per_token": backend.info.kv_bytes_per_token}


def decode_speed(args: argparse.Namespace, cache_type: str) -> float:
    """Tokens a second over the pure-decode ticks of --max-slots sequences at --prompt-tokens deep."""
    backend = LlamaCppBackend(typed(args, cache_type))
    try:
        engine = Engine(backend, EngineConfig(mode="static", max_slots=args.max_slots, n_batch=backend.info.n_batch))
        prompts = [[1000 + (i * 31 + j) % 20000 for j in range(args.prompt_tokens)] for i in range(args.max_slots)]
        engine.generate(prompts, SamplingParams(max_tokens=args.gen_tokens + 1, ignore_eos=True))
    finally:
        backend.close()
    ticks = [t for t in engine.ticks if t.plan.n_decode == args.max_slots and t.plan.n_prefill_tokens == 0]
    return args.max_slots * len(ticks) / sum(t.end - t.start for t in ticks)


def fidelity(args: argparse.Namespace, types: list[str]) -> dict:
    items = load_items(args.fidelity_prompts)
    traces = {}
    for cache_type in ["f16", *types]:  # f16 twice: the control, run to run
        backend = LlamaCppBackend(typed(args, cache_type))
        try:
            engine = Engine(backend, EngineConfig(mode="cont", max_slots=args.max_slots, n_batch=args.n_batch,
                                                  prefix_cache=False))
            trace = greedy_traces(engine, items, args.fidelity_max_new)
        finally:
            backend.close()
        traces.setdefault(cache_type, []).append(trace)
    return {t: compare_runs(traces["f16"][0], traces[t][-1]) for t in types}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(parser)
    parser.add_argument("--types", default="f16,q8_0,q4_0", help="cache types, f16 first (the fidelity reference)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=512)
    parser.add_argument("--gen-tokens", type=positive_int, default=64)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--fidelity-prompts", default="workloads/prompts_16.txt")
    parser.add_argument("--fidelity-max-new", type=positive_int, default=64)
    args = parser.parse_args()
    types = args.types.split(",")
    if types[0] != "f16":
        parser.error("--types must start with f16: the fidelity reference")
    print(f"command: .venv/bin/python bench/kv_cache_types.py --types {args.types} --max-slots {args.max_slots} "
          f"--threads {args.threads} --prompt-tokens {args.prompt_tokens} --gen-tokens {args.gen_tokens} "
          f"--repeat {args.repeat} --fidelity-prompts {args.fidelity_prompts} --fidelity-max-new "
          f"{args.fidelity_max_new}   ({time.strftime('%Y-%m-%d')})")
    sizes = {t: kv_bytes(args, t) for t in types}
    speeds: dict[str, list[float]] = {t: [] for t in types}
    for _ in range(args.repeat):
        for t in types:
            speeds[t].append(decode_speed(args, t))
    reports = fidelity(args, types)
    print("| type | KV buffer B/cell | saved B/token | decode tok/s, median (min-max) | fidelity vs f16 |")
    print("|---|---|---|---|---|")
    for t in types:
        s, v = sizes[t], speeds[t]
        verdict = reports[t].describe().splitlines()[0] + (" (f16 again: the control)" if t == "f16" else "")
        print(f"| {t} | {s['buffer_per_cell']:.0f} | {s['saved_per_token']:.0f} (estimate {s['estimate_per_token']}) "
              f"| {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | {verdict} |")
    for t, report in reports.items():
        print(f"\n{t} against f16:\n{report.describe()}")


if __name__ == "__main__":
    main()
