"""Host time per tick on a null backend: decode hands back preallocated logits at once, so everything a tick
costs is the host's (planning, KV bookkeeping, filling the batch, sampling, detokenizing, records).

    .venv/bin/python bench/engine/host_overhead.py                    # 16 and 256 slots, steady decode
    .venv/bin/python bench/engine/host_overhead.py --slots 64 --n-vocab 1024 --json out.json

Every slot decodes every tick (all requests prefilled first, then ignore_eos generation); only the ticks that
carry a full decode set and no prefill are measured. Only the public API (cobali.Engine, EngineConfig,
SamplingParams) and the backend seam are used, so the same file runs on older checkouts for before/after
figures: PYTHONPATH=/path/to/old/checkout .venv/bin/python bench/engine/host_overhead.py. The null backend takes
the members it has no use for from the stand-ins' base (cobali/backends/fake.py's StandInBackend): on a checkout
older than that base, run the checkout's own copy of this file.

    .venv/bin/python bench/engine/host_overhead.py --slots 4 --ticks 3 --n-vocab 256    # the smallest run (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import cobali
from cobali import Engine, EngineConfig, SamplingParams
from cobali.backends.base import BackendInfo, BatchArrays
from cobali.backends.fake import StandInBackend

CTX_PER_SEQ = 2048


class NullBackend(StandInBackend):
    """A model-free backend whose decode costs nothing: the logits are allocated once, token 1 wins."""

    def __init__(self, n_slots: int, n_batch: int, n_vocab: int, device_argmax: bool = False) -> None:
        self.info = BackendInfo(n_vocab=n_vocab, n_ctx=CTX_PER_SEQ * n_slots, n_ctx_seq=CTX_PER_SEQ,
                                n_seq_max=n_slots, n_batch=n_batch, kv_unified=False, description="null")
        self.logits = np.zeros((n_batch, n_vocab), dtype=np.float32)
        self.logits[:, 1] = 1.0
        self.device_argmax = device_argmax
        self.best = np.ones(n_batch, dtype=np.int64)
        self.arrays = BatchArrays.zeros(n_batch)

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        return self.logits[: int(np.count_nonzero(want_logits))]

    def argmax(self, logits: np.ndarray) -> np.ndarray:
        # As a GPU backend would (the llama.cpp one with --backend-sampling): the reduction ran in the decode.
        # Every row here is a WANT_ARGMAX row (greedy, no logprobs), so every row is picked.
        if self.device_argmax:
            return self.best[: len(logits)]
        return super().argmax(logits)

    def batch_arrays(self) -> BatchArrays:
        return self.arrays

    def remove_seq(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        pass

    def copy_seq(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        pass

    def eog_mask(self) -> np.ndarray:
        return np.zeros(self.info.n_vocab, dtype=bool)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return [2 + ord(c) % 64 for c in text]

    def token_bytes(self, token: int) -> bytes:
        return b"a"


def measure(n_slots: int, ticks: int, prompt_tokens: int, n_vocab: int, device_argmax: bool = False) -> dict:
    n_batch = max(512, n_slots)
    backend = NullBackend(n_slots, n_batch, n_vocab, device_argmax)
    engine = Engine(backend, EngineConfig(max_slots=n_slots, n_batch=n_batch))
    prefill_ticks = -(-n_slots * prompt_tokens // n_batch) + 1
    params = SamplingParams(max_tokens=prefill_ticks + ticks + 8, ignore_eos=True)
    for i in range(n_slots):
        engine.add_request([2 + (i * 7 + j) % 60 for j in range(prompt_tokens)], params)
    steady: list[float] = []
    while len(steady) < ticks:
        done = len(engine.ticks)  # read from the record list: what step() returns changed across versions
        engine.step()
        assert len(engine.ticks) > done, "the engine ran out of work before enough steady ticks"
        record = engine.ticks[-1]
        if record.plan.n_decode == n_slots and record.plan.n_prefill_tokens == 0:
            steady.append(record.host_s * 1e3)
    return {"slots": n_slots, "ticks": len(steady), "n_vocab": n_vocab, "host_ms_mean": statistics.fmean(steady),
            "host_ms_median": statistics.median(steady), "host_ms_min": min(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, nargs="+", default=[16, 256], help="decode set sizes to measure")
    parser.add_argument("--ticks", type=int, default=300, help="steady decode ticks measured per size")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--n-vocab", type=int, default=49152, help="logits width (SmolLM2's vocabulary by default)")
    parser.add_argument("--device-argmax", action="store_true",
                        help="the backend returns the greedy tokens (a GPU backend's on-device argmax) instead of "
                             "the engine reducing the logits on the host; checkouts before it ignore it")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    print(f"cobali from {cobali.__file__}")
    print(f"{'slots':>6} {'ticks':>6} {'host ms/tick mean':>18} {'median':>8} {'min':>8}")
    rows = []
    for n_slots in args.slots:
        row = measure(n_slots, args.ticks, args.prompt_tokens, args.n_vocab, args.device_argmax)
        rows.append(row)
        print(f"{row['slots']:>6} {row['ticks']:>6} {row['host_ms_mean']:>18.3f} {row['host_ms_median']:>8.3f} "
              f"{row['host_ms_min']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
