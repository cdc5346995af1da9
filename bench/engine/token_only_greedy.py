"""Decode ms per tick with greedy tokens by the host's argmax, by llama.cpp's greedy sampler alone in the graph,
and by the token-only chain (cobali/backends/llama_cpp/device_greedy.py), back to back (issue 37).

    .venv/bin/python bench/engine/token_only_greedy.py --slots 16 --threads 1 --rounds 12

Three contexts of the same model, each with `--slots` sequences decoding one row each per tick (greedy, each
fed its own tokens). A round runs `--ticks` decodes on each context in turn, so the machine's drift hits all
three alike. A tick is llama_decode and the argmax (Backend.decode + Backend.argmax). Also reports the logits
rows llama.cpp copied per tick, read outside the timed span: llama_get_sampled_logits_count_ith > 0, which
counts a context's sampling buffer where it has one (backend sampling) and its logits buffer where not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp as ll
import numpy as np

from cobali.backends.base import WANT_ARGMAX
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.device_greedy import DeviceGreedy
from cobali.config.flags import positive_int

VARIANTS = ("host argmax", "greedy sampler alone", "token-only chain")
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


class Decoder:
    """One context's sequences, decoding one row each per tick from a shared prompt."""

    def __init__(self, variant: str, args: argparse.Namespace) -> None:
        n, n_prompt = args.slots, 16
        self.backend = LlamaCppBackend(LlamaCppConfig(
            args.model, n_seq_max=n, n_ctx=n * (n_prompt + args.rounds * args.ticks + 8),
            n_batch=max(512, n * n_prompt), n_threads=args.threads, backend_sampling=variant != "host argmax"))
        prompt = self.backend.tokenize(PROMPT)[:n_prompt]
        if variant == "greedy sampler alone":
            self.backend.device_greedy = DeviceGreedy(self.backend.ctx, n, token_only=False)
        self.seqs = np.arange(n, dtype=np.int32)
        self.want = np.full(n, WANT_ARGMAX, dtype=np.int8)
        tokens = np.tile(np.array(prompt, dtype=np.int32), n)
        positions = np.tile(np.arange(len(prompt), dtype=np.int32), n)
        want = np.zeros(len(tokens), dtype=np.int8)
        want[len(prompt) - 1::len(prompt)] = WANT_ARGMAX
        self.tokens = self.backend.argmax(self.backend.decode(tokens, positions, np.repeat(self.seqs, len(prompt)),
                                                              want)).astype(np.int32)
        self.position = len(prompt)
        self.reused_before = self.backend.graphs_reused()
        self.tick_ms: list[float] = []
        self.tick_cpu_ms: list[float] = []  # this thread's CPU time: llama.cpp computes on it with one thread
        self.sampled_rows: list[int] = []

    def tick(self) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        logits = self.backend.decode(self.tokens, np.full(len(self.seqs), self.position, dtype=np.int32),
                                     self.seqs, self.want)
        self.tokens = self.backend.argmax(logits).astype(np.int32)
        self.tick_ms.append(1e3 * (time.perf_counter() - start))
        self.tick_cpu_ms.append(1e3 * (time.thread_time() - start_cpu))
        self.position += 1
        self.sampled_rows.append(sum(ll.llama_get_sampled_logits_count_ith(self.backend.ctx, row) > 0
                                     for row in range(len(self.seqs))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--slots", type=positive_int, default=16)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=12)
    parser.add_argument("--ticks", type=positive_int, default=5, help="decodes per context per round")
    args = parser.parse_args()
    decoders = {variant: Decoder(variant, args) for variant in VARIANTS}
    for _ in range(args.rounds):
        for decoder in decoders.values():
            for _ in range(args.ticks):
                decoder.tick()
    print(f"{args.slots} rows a tick, {args.threads} thread(s), {args.rounds} rounds of {args.ticks} ticks; "
          f"n_vocab {decoders[VARIANTS[0]].backend.info.n_vocab}")
    host = decoders[VARIANTS[0]]
    for variant, decoder in decoders.items():
        print(f"{variant}: logits rows copied per tick {np.mean(decoder.sampled_rows):.2f}, graphs reused "
              f"{decoder.backend.graphs_reused() - decoder.reused_before} of {len(decoder.tick_ms)} decodes")
        for label, ms, host_ms in [("wall", decoder.tick_ms, host.tick_ms),
                                   ("thread CPU", decoder.tick_cpu_ms, host.tick_cpu_ms)]:
            rounds = round_medians(ms, args)
            print(f"  {label:>10} ms per tick: median {statistics.median(ms):7.2f}, min {min(ms):7.2f}, round "
                  f"medians {rounds.min():.2f}-{rounds.max():.2f}; against the host argmax's in the same round "
                  f"{np.median(rounds / round_medians(host_ms, args)):.3f}x (median)")
        decoder.backend.close()


def round_medians(ms: list[float], args: argparse.Namespace) -> np.ndarray:
    return np.median(np.reshape(ms, (args.rounds, args.ticks)), axis=1)


if __name__ == "__main__":
    main()
