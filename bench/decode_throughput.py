"""Decode-only throughput of the engine at N slots, next to llama-batched-bench's S_TG at B=N.

    .venv/bin/python bench/decode_throughput.py --max-slots 16 [--batched-bench PATH]

Every slot gets a prompt of --prompt-tokens, then all decode --gen-tokens tokens together (ignore_eos).
Only ticks that are pure decode count, host time included: that is what S_TG measures.
"""

from __future__ import annotations

import argparse
import re
import subprocess

import numpy as np

from cobali.backends.base import SamplingParams
from cobali.config import build_backend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.options import add_backend_args, backend_config, positive_int


def engine_decode(args: argparse.Namespace) -> dict:
    backend = build_backend(backend_config(args))
    engine = Engine(backend, EngineConfig(mode="static", max_slots=args.max_slots, n_batch=args.n_batch))
    prompts = [[1000 + (i * 31 + j) % 20000 for j in range(args.prompt_tokens)] for i in range(args.max_slots)]
    engine.generate(prompts, SamplingParams(max_tokens=args.gen_tokens + 1, ignore_eos=True))
    decode = [t for t in engine.ticks if t.plan.n_decode == args.max_slots and t.plan.n_prefill_tokens == 0]
    wall = np.array([t.end - t.start for t in decode])
    host = np.array([t.host_s for t in decode])
    return {
        "ticks": len(decode),
        "tok_s": args.max_slots * len(decode) / wall.sum(),
        "tick_ms": 1e3 * wall.mean(),
        "host_ms": 1e3 * host.mean(),
        "host_share": host.sum() / wall.sum(),
    }


def batched_bench(args: argparse.Namespace, model: str) -> float:
    cmd = [args.batched_bench, "-m", model, "-c", str(args.ctx), "-b", str(args.n_batch), "-ub", str(args.n_batch),
           "-npp", str(args.prompt_tokens), "-ntg", str(args.gen_tokens), "-npl", str(args.max_slots),
           "-t", str(args.threads or 2), "--no-repack"]
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
    args = parser.parse_args()
    if not args.ctx:
        args.ctx = args.max_slots * (args.prompt_tokens + args.gen_tokens + 8)
    from cobali.backends.embedded_model import embedded_model_path

    model = args.model or embedded_model_path()
    args.model = model
    for _ in range(args.repeat):
        ours = engine_decode(args)
        print(f"cobali decode: {ours['tok_s']:.1f} tok/s at {args.max_slots} slots over {ours['ticks']} ticks; "
              f"tick {ours['tick_ms']:.2f} ms, host {ours['host_ms']:.3f} ms/tick ({ours['host_share']:.2%})")
        if args.batched_bench:
            s_tg = batched_bench(args, model)
            print(f"llama-batched-bench S_TG at B={args.max_slots}: {s_tg:.1f} tok/s; "
                  f"ratio cobali/llama = {ours['tok_s'] / s_tg:.3f}")


if __name__ == "__main__":
    main()
