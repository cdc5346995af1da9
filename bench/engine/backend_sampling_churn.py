"""What a slot changing sides costs with --backend-sampling: attaching or detaching a sequence's greedy chain
makes llama.cpp re-reserve its compute graph at the next decode.

    .venv/bin/python bench/engine/backend_sampling_churn.py --slots 16 --threads 1 --ticks 40

All slots decode one row each per tick (greedy, picked in the graph). Steady ticks keep every chain attached;
churn ticks flip slot 0 between reading its logits on the host and picking in the graph, so every decode
attaches or detaches one chain, as a request that asks logprobs arriving on a greedy slot would. Decode ms
medians, the two kinds of tick interleaved in rounds so that the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.config.flags import positive_int


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--ticks", type=positive_int, default=40, help="decodes of each kind")
    args = parser.parse_args()
    n = args.slots
    backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=n, n_ctx=n * (4 * args.ticks + 16), n_batch=max(512, n),
                                             n_threads=args.threads, backend_sampling=True))
    tokens, seqs = np.full(n, 1000, dtype=np.int32), np.arange(n, dtype=np.int32)
    argmax_only = np.full(n, WANT_ARGMAX, dtype=np.int8)
    position = 0

    def decode_ms(want: np.ndarray) -> float:
        nonlocal position, tokens
        start = time.perf_counter()
        logits = backend.decode(tokens, np.full(n, position, dtype=np.int32), seqs, want)
        tokens = backend.argmax(logits).astype(np.int32)
        position += 1
        return 1e3 * (time.perf_counter() - start)

    decode_ms(argmax_only)  # attaches every chain
    steady, churn = [], []
    for _ in range(args.ticks // 2):  # rounds: two steady decodes, then two that flip slot 0 and back
        steady += [decode_ms(argmax_only), decode_ms(argmax_only)]
        flipped = argmax_only.copy()
        flipped[0] = WANT_LOGITS
        churn += [decode_ms(flipped), decode_ms(argmax_only)]
    changes = backend.device_greedy.n_attach_changes
    backend.close()
    print(f"{n} slots, {args.threads} thread(s): decode median {statistics.median(steady):.2f} ms steady, "
          f"{statistics.median(churn):.2f} ms when a chain is attached or detached "
          f"({changes} attach changes); min {min(steady):.2f} / {min(churn):.2f} ms")


if __name__ == "__main__":
    main()
