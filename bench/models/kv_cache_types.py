"""KV cache types on one model: bytes per token, decode speed, and greedy fidelity against f16.

    .venv/bin/python bench/models/kv_cache_types.py [--types f16,q8_0,q4_0] [--max-slots 16] [--prompt-tokens 512]
        [--gen-tokens 64] [--repeat 10] [--fidelity-prompts workloads/prompts_16.txt] [--fidelity-max-new 64]

K and V take the same type (--cache-type-k/-v). Bytes per token: the KV buffer llama.cpp allocates, per cell
(from the size it logs), and what one saved token takes (llama_state_seq_get_size over a sequence's tokens).
Decode: every slot holds --prompt-tokens of context, then all decode --gen-tokens tokens together, a greedy row
each (llama_decode and the argmax, no engine around them); a round per type in turn, --repeat rounds, the median.
Fidelity: the same engine configuration run greedily with f16 and with each type, compared request by request at
the first divergence by the f16 run's logit margin there (cobali/harness/fidelity.py): under the epsilon is a
near-tie, over it a change the quantized cache made to a clear choice. f16 runs twice: the control.
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import time
from dataclasses import replace

import numpy as np

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.tools import llama_logs
from cobali.config.flags import add_backend_args, backend_config, positive_int
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.harness.fidelity import Trace, compare_runs, greedy_traces
from cobali.harness.workloads import load_items

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
        found = re.search(KV_LINE, said)
        assert found, f"llama.cpp logged no KV buffer line: {said[-500:]}"
        mib, cells, seqs = found.groups()
        n = 256
        tokens = np.array([1000 + j for j in range(n)], dtype=np.int32)
        backend.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int8))
        saved = backend.save_seq(0).nbytes
    finally:
        backend.close()
    return {"buffer_per_cell": float(mib) * 2**20 / (int(cells) * int(seqs)), "saved_per_token": saved / n,
            "estimate_per_token": backend.info.kv_bytes_per_token}


def decode_speeds(args: argparse.Namespace, types: list[str]) -> dict[str, list[float]]:
    """Tokens a second of --max-slots sequences decoding --gen-tokens together at --prompt-tokens deep, a round per
    type in turn (--repeat rounds): every type's context is prefilled once and trimmed back after each round, so
    the types share the machine's moods."""
    backends = {t: LlamaCppBackend(typed(args, t)) for t in types}
    slots, depth = args.max_slots, args.prompt_tokens
    speeds: dict[str, list[float]] = {t: [] for t in types}
    try:
        for backend in backends.values():
            for seq in range(slots):
                tokens = np.array([1000 + (seq * 31 + j) % 20000 for j in range(depth)], dtype=np.int32)
                for at in range(0, depth, backend.info.n_batch):
                    part = tokens[at:at + backend.info.n_batch]
                    backend.decode(part, np.arange(at, at + len(part), dtype=np.int32),
                                   np.full(len(part), seq, dtype=np.int32), np.zeros(len(part), dtype=np.int8))
        seqs, want = np.arange(slots, dtype=np.int32), np.ones(slots, dtype=np.int8)
        for _ in range(args.repeat):
            for t, backend in backends.items():
                tokens = np.full(slots, 1000, dtype=np.int32)
                start = time.perf_counter()
                for step in range(args.gen_tokens):
                    logits = backend.decode(tokens, np.full(slots, depth + step, dtype=np.int32), seqs, want)
                    tokens = backend.argmax(logits).astype(np.int32)
                speeds[t].append(slots * args.gen_tokens / (time.perf_counter() - start))
                for seq in range(slots):
                    backend.remove_seq(seq, depth, -1)
    finally:
        for backend in backends.values():
            backend.close()
    return speeds


def fidelity(args: argparse.Namespace, types: list[str]) -> dict:
    items = load_items(args.fidelity_prompts)
    traces: dict[str, list[list[Trace]]] = {}
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
    parser.add_argument("--repeat", type=positive_int, default=10, help="decode rounds per type")
    parser.add_argument("--fidelity-prompts", default="workloads/prompts_16.txt", help="'' skips fidelity")
    parser.add_argument("--fidelity-max-new", type=positive_int, default=64)
    args = parser.parse_args()
    types = args.types.split(",")
    if types[0] != "f16":
        parser.error("--types must start with f16: the fidelity reference")
    print(f"command: .venv/bin/python bench/models/kv_cache_types.py --types {args.types} --max-slots {args.max_slots} "
          f"--threads {args.threads} --prompt-tokens {args.prompt_tokens} --gen-tokens {args.gen_tokens} "
          f"--repeat {args.repeat} --fidelity-prompts {shlex.quote(args.fidelity_prompts)} --fidelity-max-new "
          f"{args.fidelity_max_new}   ({time.strftime('%Y-%m-%d')})")
    sizes = {t: kv_bytes(args, t) for t in types}
    speeds = decode_speeds(args, types)
    reports = fidelity(args, types) if args.fidelity_prompts else {}
    print("| type | KV buffer B/cell | saved B/token | decode tok/s, median (min-max) | fidelity vs f16 |")
    print("|---|---|---|---|---|")
    for t in types:
        s, v = sizes[t], speeds[t]
        verdict = reports[t].describe().splitlines()[0] if reports else "not run"
        verdict += " (f16 again: the control)" if reports and t == "f16" else ""
        print(f"| {t} | {s['buffer_per_cell']:.0f} | {s['saved_per_token']:.0f} (estimate {s['estimate_per_token']}) "
              f"| {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | {verdict} |")
    for t, report in reports.items():
        print(f"\n{t} against f16:\n{report.describe()}")


if __name__ == "__main__":
    main()
