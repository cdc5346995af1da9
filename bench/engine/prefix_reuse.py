"""64 chats sharing one ~400-token system prompt, with and without prefix reuse.

    .venv/bin/python bench/engine/prefix_reuse.py [--chats 64] [--max-new 16] [--max-slots 16]

The system prompt is built from workloads/prompts_186.txt, the user turns from workloads/short_burst.json;
each chat goes through the model's chat template. Both runs share one backend and submit everything at t=0.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from cobali.config.flags import add_engine_args, engine_setup, positive_int
from cobali.engine.engine import Engine
from cobali.engine.setup import build_backend
from cobali.harness.driver import LoadOptions, run_workload
from cobali.harness.workloads import WorkItem

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def chats(backend, n_chats: int, system_tokens: int) -> list[WorkItem]:
    words = (WORKLOADS / "prompts_186.txt").read_text().split()
    system = "You are a helpful assistant for Python programmers. Reference notes follow."
    for word in words:
        if len(backend.tokenize(system + " " + word)) > system_tokens:
            break
        system += " " + word
    questions = [r["prompt"] for r in json.loads((WORKLOADS / "short_burst.json").read_text())["requests"]]
    users = [questions[i % len(questions)] + ("" if i < len(questions) else " Answer briefly.")
             for i in range(n_chats)]
    return [WorkItem(backend.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": u}])) for u in users]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--chats", type=positive_int, default=64)
    parser.add_argument("--system-tokens", type=positive_int, default=400)
    parser.add_argument("--max-new", type=positive_int, default=16)
    args = parser.parse_args()
    spec = engine_setup(args)
    backend = build_backend(spec.backend)
    items = chats(backend, args.chats, args.system_tokens)
    assert isinstance(items[0].prompt, str)  # chats are text
    first = len(backend.tokenize(items[0].prompt))
    print(f"{len(items)} chats, first prompt {first} tokens, {backend.info.description}")
    rows = {}
    for cached in (False, True):
        engine = Engine(backend, replace(spec.engine, prefix_cache=cached))
        summary = run_workload(engine, items, LoadOptions(args.max_new, ignore_eos=True), progress=None).summary()
        rows[cached] = summary
        print(f"prefix cache {'on ' if cached else 'off'}: wall {summary['wall_s']:.2f} s, "
              f"TTFT p50 {summary['ttft_p50_ms']:.0f} ms, p99 {summary['ttft_p99_ms']:.0f} ms, "
              f"hit tokens {engine.stats().prefix_hit_tokens} of {engine.stats().prefix_queried_tokens} queried")
    off, on = rows[False], rows[True]
    print(f"ratios off/on: TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x, "
          f"wall {off['wall_s'] / on['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
