"""What a mixed tick costs by where its prompt chunks sit: with per-sequence KV streams llama.cpp cuts a batch
into micro-batches of consecutive seq_ids taking as many tokens from each (split_equal), so the decode rows and
each prompt's first token run in one forward pass, then the rest of the prompts run one pass per run of
consecutive slots. Prompts in scattered slots cost one more pass each; with a unified KV (split_simple) the
whole batch is one pass wherever they sit.

    .venv/bin/python bench/engine/mixed_ubatches.py                 # 16 decode rows + 3 prompts of 100 tokens
    .venv/bin/python bench/engine/mixed_ubatches.py --kv-unified

Each line: the median ms of `--repeat` decodes of the same batch, the two cases taking turns (decode rows
`--depth` tokens deep in slots 0..N-1; the prompts in the next slots, or `--gap` slots apart).
"""

from __future__ import annotations

import argparse
import statistics

from kv_streams import fill
from prefill_tile import decode_ms

from cobali.backends.llama_cpp.backend import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.config.flags import positive_int


def mixed_ms(backend: LlamaCppBackend, decode_rows: int, depth: int, prompt_slots: list[int],
             prompt_tokens: int) -> float:
    rows = [(7, depth, s, 1) for s in range(decode_rows)]
    for s in prompt_slots:
        rows += [(200 + i % 50, i, s, int(i == prompt_tokens - 1)) for i in range(prompt_tokens)]
    ms = decode_ms(backend, rows)
    for s in range(decode_rows):
        backend.remove_seq(s, depth, -1)
    for s in prompt_slots:
        backend.remove_seq(s)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-rows", type=positive_int, default=16)
    parser.add_argument("--depth", type=positive_int, default=50, help="context of each decode row")
    parser.add_argument("--prompts", type=positive_int, default=3)
    parser.add_argument("--prompt-tokens", type=positive_int, default=100)
    parser.add_argument("--gap", type=positive_int, default=3, help="slots between scattered prompts")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeat", type=positive_int, default=10)
    parser.add_argument("--kv-unified", action="store_true")
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded model)")
    args = parser.parse_args()
    if args.decode_rows + args.prompts * args.prompt_tokens > 512:
        parser.error("the batch must fit n_batch (512): lower --decode-rows, --prompts or --prompt-tokens")
    first = args.decode_rows
    cases = {"consecutive": [first + i for i in range(args.prompts)],
             "scattered": [first + i * args.gap for i in range(args.prompts)]}
    slots = max(cases["scattered"]) + 1
    backend = LlamaCppBackend(LlamaCppConfig(model_path=args.model, n_seq_max=slots, n_threads=args.threads,
                                             kv_unified=args.kv_unified))
    for s in range(args.decode_rows):
        fill(backend, s, args.depth)
    layout = "one unified KV" if args.kv_unified else "per-sequence KV streams"
    print(f"{args.decode_rows} decode rows + {args.prompts} prompts of {args.prompt_tokens} tokens, {layout} "
          f"(ms per decode, median of {args.repeat})")
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeat):  # the cases take turns, so a slow spell of the machine falls on both
        for name, prompt_slots in cases.items():
            times[name].append(mixed_ms(backend, args.decode_rows, args.depth, prompt_slots, args.prompt_tokens))
    for name, prompt_slots in cases.items():
        print(f"  prompts in slots {prompt_slots} ({name}){statistics.median(times[name]):>12.1f}")
    backend.close()


if __name__ == "__main__":
    main()
