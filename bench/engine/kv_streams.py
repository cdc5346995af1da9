"""What a decode costs by which sequences it carries, with per-sequence KV streams (llama.cpp's layout here):
llama.cpp runs one forward pass per run of consecutive seq_ids among a batch's rows, and its attention views
every stream from a pass's lowest seq_id to its highest, so the same rows cost more when their seq_ids are
scattered or leave a gap; where the run sits, and what the other streams hold, should not matter. cobali's
scheduler closes a gap by moving the request in the highest slot into it (a whole-stream copy,
llama_memory_seq_cp across streams): the last line prices that copy.

    .venv/bin/python bench/engine/kv_streams.py                  # 8 rows of 16 slots, 300 tokens deep, 2 threads
    .venv/bin/python bench/engine/kv_streams.py --rows 4 --threads 1

Each line: the median ms of `--repeat` decodes of one row for each of `--rows` sequences (all `--depth`
tokens deep), for one choice of seq_ids: the lowest slots, the highest, the lowest with one or two gaps, or
spread over all of them; then the lowest and the spread again with a `--idle-depth`-token prompt in each slot
neither uses, as cached prefixes left in free slots are. Last: how much longer a decode of the lowest slots
takes when its KV update first applies one such copy.
"""

from __future__ import annotations

import argparse
import statistics

from prefill_tile import decode_ms

from cobali.backends.llama_cpp.backend import LlamaCppBackend
from cobali.backends.llama_cpp.config import DEFAULT_CTX_PER_SEQ, LlamaCppConfig
from cobali.config.flags import positive_int


def fill(backend: LlamaCppBackend, seq: int, n: int) -> None:
    backend.remove_seq(seq)
    for lo in range(0, n, 500):  # in batches that fit n_batch
        decode_ms(backend, [(100 + (i + seq) % 50, i, seq, 0) for i in range(lo, min(n, lo + 500))])


def median_decode_ms(backend: LlamaCppBackend, seqs: list[int], depth: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        times.append(decode_ms(backend, [(7, depth, s, 1) for s in seqs]))
        for s in seqs:
            backend.remove_seq(s, depth, -1)
    return statistics.median(times)


def move_ms(backend: LlamaCppBackend, rows: int, depth: int, repeat: int) -> float:
    """A decode of the lowest `rows` slots right after a request's KV moved between the two slots above them
    (llama.cpp copies at the decode's KV update), less the same decode without a move; medians."""
    with_move, plain = [], []
    for i in range(repeat):
        src, dst = (rows, rows + 1) if i % 2 == 0 else (rows + 1, rows)
        backend.copy_seq(src, dst)
        backend.remove_seq(src)
        with_move.append(median_decode_ms(backend, list(range(rows)), depth, 1))
        plain.append(median_decode_ms(backend, list(range(rows)), depth, 1))
    return statistics.median(with_move) - statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=8, help="decode rows (at most half the slots)")
    parser.add_argument("--slots", type=positive_int, default=16)
    parser.add_argument("--depth", type=positive_int, default=300)
    parser.add_argument("--idle-depth", type=positive_int, default=1500)
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--repeat", type=positive_int, default=20)
    args = parser.parse_args()
    if 2 * args.rows > args.slots:
        parser.error(f"--rows must be at most half of --slots ({args.slots}), got {args.rows}")
    if max(args.depth, args.idle_depth) >= DEFAULT_CTX_PER_SEQ:
        parser.error(f"--depth and --idle-depth must be under {DEFAULT_CTX_PER_SEQ}, got {args.depth} and "
                     f"{args.idle_depth}")
    backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=args.slots, n_threads=args.threads))
    low, high = list(range(args.rows)), list(range(args.slots - args.rows, args.slots))
    gapped = {"one gap": [s for s in range(args.rows + 1) if s != args.rows // 2],
              "two gaps": [s for s in range(args.rows + 2) if s not in (args.rows // 3, 2 * args.rows // 3 + 1)]}
    spread = [round(i * (args.slots - 1) / (args.rows - 1)) for i in range(args.rows)] if args.rows > 1 else [0]
    used = sorted(set(low + high + spread + [s for seqs in gapped.values() for s in seqs]))
    for s in used:
        fill(backend, s, args.depth)
    print(f"{args.rows} decode rows, {args.depth} tokens deep, {args.slots} slots (ms per decode, median)")
    cases = [(f"lowest slots {low}", low), (f"highest slots {high}", high),
             *((f"{name} {seqs}", seqs) for name, seqs in gapped.items()),
             (f"spread over the slots {spread}", spread)]
    for name, seqs in cases:
        print(f"  {name:<52}{median_decode_ms(backend, seqs, args.depth, args.repeat):8.1f}")
    idle = [s for s in range(args.slots) if s not in low + spread]
    for s in idle:
        fill(backend, s, args.idle_depth)
    for name, seqs in (cases[0], cases[-1]):
        label = f"{name}, {args.idle_depth} tokens in slots {idle}"
        print(f"  {label:<52}{median_decode_ms(backend, seqs, args.depth, args.repeat):8.1f}")
    label = "lowest slots, a request's KV moved first (difference)"
    print(f"  {label:<52}{move_ms(backend, args.rows, args.depth, args.repeat):+8.1f}")


if __name__ == "__main__":
    main()
