"""Decode-only throughput of the engine at N slots, next to llama-batched-bench's S_TG at B=N.

    .venv/bin/python bench/engine/decode_throughput.py --max-slots 16 [--batched-bench PATH]
    .venv/bin/python bench/engine/decode_throughput.py --max-slots 64 --threads 1 --repeat 3 --both-sampling-paths

Every slot gets a prompt of --prompt-tokens, then all decode --gen-tokens tokens together (ignore_eos).
Only ticks that are pure decode count, host time included: that is what S_TG measures. --both-sampling-paths
runs each repeat twice back to back: greedy tokens by the host's argmax, then picked in llama.cpp's graph
(--backend-sampling); argmax ms is the host's share of it (Backend.argmax).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from dataclasses import replace

import numpy as np

from cobali.backends.base import Backend
from cobali.backends.llama_cpp.loading import repack_flag
from cobali.config.flags import add_backend_args, backend_config, positive_int
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.setup import build_backend
from cobali.frontend.offline import LLM


def engine_decode(args: argparse.Namespace, backend_sampling: bool | None = None) -> dict:
    config = backend_config(args)
    if backend_sampling is not None:
        config = replace(config, backend_sampling=backend_sampling)
    backend = build_backend(config)
    # llama.cpp caps n_batch at the context, which is small for short runs: take what the context got.
    engine = Engine(backend, EngineConfig(mode="static", max_slots=args.max_slots, n_batch=backend.info.n_batch))
    argmax_s = timed_per_tick(engine, backend, "argmax")
    prompts = [[1000 + (i * 31 + j) % 20000 for j in range(args.prompt_tokens)] for i in range(args.max_slots)]
    LLM(engine).generate(prompts, SamplingParams(max_tokens=args.gen_tokens + 1, ignore_eos=True))
    backend.close()
    decode = [i for i, t in enumerate(engine.ticks)
              if t.plan.n_decode == args.max_slots and t.plan.n_prefill_tokens == 0]
    ticks = [engine.ticks[i] for i in decode]
    wall = np.array([t.end - t.start for t in ticks])
    host = np.array([t.host_s for t in ticks])
    return {
        "ticks": len(ticks),
        "tok_s": args.max_slots * len(ticks) / wall.sum(),
        "tick_ms": 1e3 * wall.mean(),
        "decode_ms": 1e3 * np.mean([t.decode_s for t in ticks]),
        "host_ms": 1e3 * host.mean(),
        "argmax_ms": 1e3 * np.mean([argmax_s.get(i, 0.0) for i in decode]),
        "host_share": host.sum() / wall.sum(),
    }


def timed_per_tick(engine: Engine, backend: Backend, method: str) -> dict[int, float]:
    """Seconds spent in the engine's backend.`method`, by index of the tick (in engine.ticks) that called it."""
    seconds: dict[int, float] = {}
    inner = getattr(backend, method)

    def timing(*args):
        start = time.perf_counter()
        result = inner(*args)
        tick = len(engine.ticks)  # the tick calling is recorded when it ends
        seconds[tick] = seconds.get(tick, 0.0) + time.perf_counter() - start
        return result

    setattr(backend, method, timing)
    return seconds


def report(label: str, row: dict, n_slots: int) -> None:
    print(f"{label}: {row['tok_s']:.1f} tok/s at {n_slots} slots over {row['ticks']} ticks; tick "
          f"{row['tick_ms']:.2f} ms (decode {row['decode_ms']:.2f}), host {row['host_ms']:.3f} ms/tick "
          f"({row['host_share']:.2%}), of it argmax {row['argmax_ms']:.3f} ms")


def batched_bench(args: argparse.Namespace, model: str) -> float:
    cmd = [args.batched_bench, "-m", model, "-c", str(args.ctx), "-b", str(args.n_batch), "-ub", str(args.n_batch),
           "-npp", str(args.prompt_tokens), "-ntg", str(args.gen_tokens), "-npl", str(args.max_slots),
           "-t", str(args.threads or 2), repack_flag(model, args.repack)]  # as cobali loads it
    if args.kv_unified:
        cmd.append("-kvu")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    print(out.strip().splitlines()[-1])
    # Result rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line for line in out.splitlines() if re.match(r"\|\s+\d+", line)]
    return float(rows[-1].split("|")[8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_args(parser)
    parser.add_argument("--prompt-tokens", type=positive_int, default=128)
    parser.add_argument("--gen-tokens", type=positive_int, default=128)
    parser.add_argument("--batched-bench", default=None, help="path of llama-batched-bench to compare with")
    parser.add_argument("--repeat", type=positive_int, default=1)
    parser.add_argument("--both-sampling-paths", action="store_true",
                        help="each repeat: host argmax, then greedy tokens picked in llama.cpp's graph")
    parser.add_argument("--json", default=None, help="also write cobali's rows here (a list, one per run)")
    args = parser.parse_args()
    if not args.ctx:
        args.ctx = args.max_slots * (args.prompt_tokens + args.gen_tokens + 8)
    from cobali.backends.embedded_model import embedded_model_path

    model = args.model or embedded_model_path()
    args.model = model
    rows = []
    for _ in range(args.repeat):
        if args.both_sampling_paths:
            for label, on in (("host argmax  ", False), ("graph argmax ", True)):
                rows.append({"sampling": label.strip(), **engine_decode(args, backend_sampling=on)})
                report(label, rows[-1], args.max_slots)
            continue
        rows.append(engine_decode(args))
        report("cobali decode", rows[-1], args.max_slots)
        if args.batched_bench:
            s_tg = batched_bench(args, model)
            print(f"llama-batched-bench S_TG at B={args.max_slots}: {s_tg:.1f} tok/s; "
                  f"ratio cobali/llama = {rows[-1]['tok_s'] / s_tg:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
