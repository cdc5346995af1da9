"""A held-out serving workload: prompts cut from documentation that no one here wrote and that the shipped
workloads do not use (the docstrings of numpy, an installed dependency), built at run time, never committed.

    .venv/bin/python bench/tools/held_out_workload.py --out results/held_out.json [--requests 48] [--seed 7]

Each request is 1 to 14 consecutive prose paragraphs, followed by one task, with max_tokens drawn from 16 to
256 (the serving client sends ignore_eos, so every server generates exactly that many). A prompt is cut back to
whole paragraphs under --max-chars (~4 characters a token) so prompt plus output fits a 2048-cell slot.

    .venv/bin/python bench/tools/held_out_workload.py --out results/chats.json --turns 4 [--requests 48]

With --turns T, the requests are --requests / T chats of T turns, listed turn by turn (every chat's first
turn, then every second one, ...): a turn's prompt is the chat's previous prompt, a stand-in for the reply
(the paragraph after those it quoted), then 1 to 3 new paragraphs and a task, as a chat client resends the
conversation. A server that keeps each chat's KV between its turns prefills only what is new.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workloads"))
from make_workloads import prose_paragraphs  # a script beside the workloads, not a package

SOURCES = (np, np.linalg, np.fft, np.random, np.polynomial, np.ma, np.lib)
TASKS = (
    "Summarize the documentation above for a new user.",
    "List the main points of the text above.",
    "Explain the text above in plain English.",
    "Write a short tutorial based on the documentation above.",
    "What questions might a reader still have after reading the text above?",
)


def paragraphs() -> list[str]:
    """Every prose paragraph of the sources' public docstrings, in a fixed order, each once."""
    seen: set[str] = set()
    out: list[str] = []
    for module in SOURCES:
        for name in sorted(dir(module)):
            doc = None if name.startswith("_") else inspect.getdoc(getattr(module, name, None))
            for para in prose_paragraphs(doc or ""):
                if para not in seen:
                    seen.add(para)
                    out.append(para)
    return out


def build(n: int, seed: int, max_chars: int) -> dict:
    corpus, rng = paragraphs(), random.Random(seed)
    requests: list[dict[str, Any]] = []
    for _ in range(n):
        start, count = rng.randrange(len(corpus)), rng.randint(1, 14)
        chosen = corpus[start:start + count]
        while len(chosen) > 1 and sum(map(len, chosen)) > max_chars:
            chosen.pop()
        prompt = "\n\n".join([*chosen, rng.choice(TASKS)])
        requests.append({"prompt": prompt, "max_tokens": rng.randint(16, 256)})
    chars = [len(r["prompt"]) for r in requests]
    return {
        "name": "held_out_numpy_docs",
        "description": (f"{n} requests cut from numpy {np.__version__}'s docstrings ({len(corpus)} paragraphs), "
                        f"1-14 paragraphs each ({min(chars)}-{max(chars)} chars), max_tokens 16-256, seed {seed}"),
        "requests": requests,
    }


def chat(corpus: list[str], rng: random.Random, turns: int, max_chars: int) -> list[str]:
    """One chat's prompts, each the previous one, a stand-in reply, new paragraphs and a task; the last one
    under max_chars."""
    at, budget = rng.randrange(len(corpus)), max_chars // turns
    prompts: list[str] = []
    for _ in range(turns):
        reply = [corpus[at % len(corpus)][:budget // 4]] if prompts else []
        new = [p[:budget // 2] for p in corpus[at + 1:at + 1 + rng.randint(1, 3)]] or [corpus[0][:budget // 2]]
        while len(new) > 1 and sum(map(len, new)) > budget // 2:
            new.pop()
        at += 1 + len(new)
        prompts.append("\n\n".join([*prompts[-1:], *reply, *new, rng.choice(TASKS)]))
    return prompts


def build_chats(n: int, turns: int, seed: int, max_chars: int) -> dict:
    if n % turns:
        raise ValueError(f"--requests must be a multiple of --turns ({turns}), got {n}")
    corpus, rng = paragraphs(), random.Random(seed)
    chats = [chat(corpus, rng, turns, max_chars) for _ in range(n // turns)]
    requests = [{"prompt": c[t], "max_tokens": rng.randint(16, 256)} for t in range(turns) for c in chats]
    return {
        "name": "held_out_numpy_chats",
        "description": (f"{len(chats)} chats of {turns} turns cut from numpy {np.__version__}'s docstrings, listed "
                        f"turn by turn, each turn resending the chat so far; max_tokens 16-256, seed {seed}"),
        "requests": requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-chars", type=int, default=6000)
    parser.add_argument("--turns", type=int, default=1, help="turns per chat (1: independent prompts)")
    args = parser.parse_args()
    if args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    try:
        workload = (build(args.requests, args.seed, args.max_chars) if args.turns == 1
                    else build_chats(args.requests, args.turns, args.seed, args.max_chars))
    except ValueError as e:
        parser.error(str(e))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(workload, indent=1))
    print(f"wrote {args.out}: {workload['description']}")


if __name__ == "__main__":
    main()
