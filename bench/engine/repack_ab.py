"""Weight repacking on and off, back to back through the backend seam: the prefill of one chunk and a decode of
every slot, for each model, alternating which goes first in each round (docs/results.md, "Weight repacking on the
CPU (issue 49)").

    .venv/bin/python bench/engine/repack_ab.py --model A.gguf --model B.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.config.flags import positive_int
from cobali.faces.calibrate import time_batch


def measure(path: str | None, repack: bool, args: argparse.Namespace) -> dict:
    slots, kv = args.slots, args.kv
    backend = LlamaCppBackend(LlamaCppConfig(path, n_ctx=slots * (kv + 64) + args.prefill_tokens, n_seq_max=slots,
                                             n_batch=max(512, args.prefill_tokens), n_threads=args.threads,
                                             repack=repack))
    try:
        time_batch(backend, [(slots - 1, p) for p in range(64)], 1)  # warm-up
        prefill = time_batch(backend, [(slots - 1, p) for p in range(args.prefill_tokens)], args.repeats)
        pos = np.arange(kv, dtype=np.int32)
        backend.decode((1000 + pos).astype(np.int32), pos, np.zeros(kv, np.int32), np.zeros(kv, np.int8))
        for seq in range(1, slots):
            backend.copy_seq(0, seq, 0, -1)
        decode = time_batch(backend, [(seq, kv) for seq in range(slots)], 3 * args.repeats)
        return {"repacked": backend.weights_repacked, "prefill_tok_s": round(args.prefill_tokens / prefill, 1),
                "decode_tok_s": round(slots / decode, 1)}
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", default=None, help="GGUF (repeatable; default: the embedded)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed decodes per point (decode: 3x)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512)
    parser.add_argument("--slots", type=positive_int, default=16, help="decoding sequences")
    parser.add_argument("--kv", type=positive_int, default=256, help="each decoding sequence's context")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    for round_ in range(args.rounds):
        for path in args.model or [None]:
            for repack in (True, False) if round_ % 2 == 0 else (False, True):
                row = {"round": round_, "model": path or "embedded", "repack": repack, **measure(path, repack, args)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
