"""What a grammar costs a sampled request: the same requests unconstrained, under a generic JSON grammar, a JSON
schema and a regex, back to back on one model load, several rounds alternating.

    .venv/bin/python bench/structured/grammar_sampling.py --requests 8 --slots 8 --max-new 64 --rounds 2

--temperature 0 is greedy; --top-p below 1 makes the chain truncate. Either way a constrained row is masked by
llguidance before the chain draws (cobali/structured/guide.py).

Host time is the tick's time outside llama_decode: sampling, masks and bookkeeping. Compile time is each
grammar's first compile, against the model's vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.structured.grammars import JSON_OBJECT_GRAMMAR, json_schema_grammar, regex_grammar

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "year", "tags"]}
GRAMMARS = {"none": None, "json_object": JSON_OBJECT_GRAMMAR, "schema": json_schema_grammar(SCHEMA),
            "regex": regex_grammar(r"[A-Z][a-z]+( [a-z]+){0,60}\.")}


def run(backend: LlamaCppBackend, grammar: str | None, requests: int, slots: int, max_new: int,
        top_p: float = 1.0, temperature: float = 1.0) -> dict:
    engine = Engine(backend, EngineConfig(max_slots=slots, prefix_cache=False))
    compile_ms = 0.0
    if grammar is not None:
        _ = engine.grammars.tokenizer  # the vocabulary read once, before the clock
        compiled = time.perf_counter()
        engine.grammars.check(grammar)
        compile_ms = (time.perf_counter() - compiled) * 1e3
    start = time.perf_counter()
    done = [engine.add_request("Describe a film as JSON.", SamplingParams(
        max_tokens=max_new, temperature=temperature, top_p=top_p, seed=i, grammar=grammar)) for i in range(requests)]
    list(LLM(engine).run())
    wall = time.perf_counter() - start
    tokens = sum(len(r.output_tokens) for r in done)
    host = sum(t.host_s for t in engine.ticks)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "host_ms_per_token": host / tokens * 1e3,
            "compile_ms": compile_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    backend = LlamaCppBackend(LlamaCppConfig(embedded_model_path(), n_seq_max=args.slots, n_threads=args.threads))
    results: dict[str, list[dict]] = {name: [] for name in GRAMMARS}
    try:
        run(backend, None, 2, min(2, args.slots), 8)  # warm-up
        for _ in range(args.rounds):
            for name, grammar in GRAMMARS.items():
                results[name].append(run(backend, grammar, args.requests, args.slots, args.max_new, args.top_p,
                                         args.temperature))
    finally:
        backend.close()
    print(f"{'constraint':<12} {'tokens':>7} {'tok/s':>14} {'host ms/token':>15} {'compile ms':>15}")
    for name, rounds in results.items():
        print(f"{name:<12} {statistics.mean(r['tokens'] for r in rounds):>7.0f} "
              f"{per_round(rounds, 'tok_per_s'):>14} {per_round(rounds, 'host_ms_per_token'):>15} "
              f"{per_round(rounds, 'compile_ms'):>15}")


def per_round(rounds: list[dict], key: str) -> str:
    return " / ".join(f"{r[key]:.2f}" for r in rounds)


if __name__ == "__main__":
    main()
