"""What a prefill chunk costs by size and depth, beside a few decode rows, on the real model: is a chunk
shorter than the backend's prefill tile (65 tokens, llama_cpp_config.PREFILL_TILE) slower per token?

    .venv/bin/python bench/engine/prefill_tile.py                        # depths 0-1500, sizes 32-65, 2 threads
    .venv/bin/python bench/engine/prefill_tile.py --depths 500 --sizes 64 65 --threads 1

Each cell: ms of one decode carrying a chunk of n prompt tokens of sequence 0, starting at `depth`, and one
decode row of each of `--decode-rows` other sequences (200 tokens deep); the best of `--repeat` runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cobali.backends.llama_cpp.backend import LlamaCppBackend
from cobali.backends.llama_cpp.config import DEFAULT_CTX_PER_SEQ, LlamaCppConfig
from cobali.config.flags import non_negative_int, positive_int

Row = tuple[int, int, int, int]  # token, position, sequence, wants logits


def decode_ms(backend: LlamaCppBackend, rows: list[Row]) -> float:
    columns = zip(*rows, strict=True)
    tokens, positions, seqs = (np.array(next(columns), dtype=np.int32) for _ in range(3))
    want = np.array(next(columns), dtype=np.int8)
    start = time.perf_counter()
    backend.decode(tokens, positions, seqs, want)
    return (time.perf_counter() - start) * 1e3


def chunk_ms(backend: LlamaCppBackend, depth: int, n: int, decode_rows: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        backend.remove_seq(0)
        for lo in range(0, depth, 500):  # the prompt before the chunk, in batches that fit n_batch
            decode_ms(backend, [(200 + i % 50, i, 0, 0) for i in range(lo, min(depth, lo + 500))])
        chunk = [(300 + i % 50, depth + i, 0, int(i == n - 1)) for i in range(n)]
        best = min(best, decode_ms(backend, chunk + [(7, 200, s, 1) for s in range(1, decode_rows + 1)]))
        for s in range(1, decode_rows + 1):
            backend.remove_seq(s, 200, -1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=non_negative_int, nargs="+", default=[0, 256, 500, 1000, 1500])
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[32, 48, 64, 65])
    parser.add_argument("--decode-rows", type=positive_int, default=3)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeat", type=positive_int, default=3)
    args = parser.parse_args()
    if max(args.depths) + max(args.sizes) > DEFAULT_CTX_PER_SEQ:
        parser.error(f"--depths and --sizes must stay within 0..{DEFAULT_CTX_PER_SEQ} positions, got {args.depths} "
                     f"and {args.sizes}")
    if max(args.sizes) + args.decode_rows > 512:
        parser.error(f"a chunk and its decode rows must fit one 512-token batch, got {args.sizes}")
    backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=args.decode_rows + 1, n_threads=args.threads))
    for s in range(1, args.decode_rows + 1):
        decode_ms(backend, [(100 + i, i, s, int(i == 199)) for i in range(200)])
    print("depth " + "".join(f"{n:>10} tok" for n in args.sizes) + "   (ms per decode)")
    for depth in args.depths:
        cells = [chunk_ms(backend, depth, n, args.decode_rows, args.repeat) for n in args.sizes]
        print(f"{depth:>5} " + "".join(f"{ms:>14.1f}" for ms in cells))


if __name__ == "__main__":
    main()
