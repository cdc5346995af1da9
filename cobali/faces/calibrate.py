"""`cobali calibrate`: measure the backend on this machine and save a cost profile.

Four kinds of batch are timed straight through the backend seam (no scheduler in the way):
prefill chunks of several sizes, chunks resumed deep into a long prompt (some shorter than the backend's
prefill tile, as a warm turn's few new tokens are), decode steps for several sequence counts and context
lengths, and prefill chunks with every slot's decode row mixed in.
The model's characters per token, over a sample of text prompts, is recorded for the simulator.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import numpy as np

from cobali.backends.base import Backend
from cobali.config.flags import add_backend_args, backend_config, positive_int
from cobali.engine.costs import CostProfile, Measurement, TickTerms, chunk_kv_tokens, user_profiles_dir
from cobali.engine.setup import build_backend
from cobali.harness.workloads import load_items

PREFILL_SIZES = (32, 64, 128, 256, 512)
DECODE_SEQS = (1, 2, 4, 8, 16)
DECODE_KV = (128, 512)
MIX_SIZES = (64, 256)
DEEP_SIZES = (16, 32, 128, 256)  # below and above llama.cpp's tile of 65 (BackendInfo.prefill_tile)
DEEP_STARTS = (512, 1024, 1536)
SOURCE_SEQ = 0


def time_batch(backend: Backend, rows: Sequence[tuple[int, int]], repeats: int) -> float:
    """Median seconds of one decode of `rows` (seq_id, position) pairs; their KV is dropped after each."""
    seqs = np.array([s for s, _ in rows], dtype=np.int32)
    pos = np.array([p for _, p in rows], dtype=np.int32)
    tokens = (1000 + pos % 5000).astype(np.int32)
    want = np.zeros(len(rows), dtype=np.int8)
    want[-1] = 1
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.decode(tokens, pos, seqs, want)
        times.append(time.perf_counter() - start)
        for seq, first in {s: int(pos[seqs == s].min()) for s in set(seqs.tolist())}.items():
            backend.remove_seq(seq, first, -1)
    return statistics.median(times)


def _fill(backend: Backend, n_seqs: int, kv_len: int, n_batch: int) -> None:
    """Give sequences 0..n_seqs-1 a context of kv_len tokens: compute it once, copy it to the rest."""
    for seq in range(n_seqs):
        backend.remove_seq(seq)
    for start in range(0, kv_len, n_batch):
        n = min(n_batch, kv_len - start)
        pos = np.arange(start, start + n, dtype=np.int32)
        backend.decode((1000 + pos).astype(np.int32), pos, np.full(n, SOURCE_SEQ, np.int32), np.zeros(n, np.int8))
    for seq in range(1, n_seqs):
        backend.copy_seq(SOURCE_SEQ, seq, 0, -1)


def measure(backend: Backend, max_slots: int, n_batch: int, repeats: int = 3) -> list[Measurement]:
    points: list[Measurement] = []
    fresh = max_slots - 1  # a sequence kept empty for prefill chunks
    for size in (s for s in PREFILL_SIZES if s <= n_batch):
        backend.remove_seq(fresh)
        seconds = time_batch(backend, [(fresh, p) for p in range(size)], repeats)
        points.append(Measurement(TickTerms(size, 0, 0, chunk_kv_tokens(size, 0)), seconds))
    points += measure_deep_prefill(backend, fresh, n_batch, repeats)
    decode_seqs = [n for n in DECODE_SEQS if n < max_slots] or [1]
    for kv_len in DECODE_KV:
        _fill(backend, max(decode_seqs), kv_len, n_batch)
        for n in decode_seqs:
            seconds = time_batch(backend, [(s, kv_len) for s in range(n)], repeats)
            points.append(Measurement(TickTerms(0, n, n * kv_len), seconds))
        for size in (s for s in MIX_SIZES if s + max(decode_seqs) <= n_batch):
            n = max(decode_seqs)
            backend.remove_seq(fresh)
            rows = [(s, kv_len) for s in range(n)] + [(fresh, p) for p in range(size)]
            terms = TickTerms(size, n, n * kv_len, chunk_kv_tokens(size, 0))
            points.append(Measurement(terms, time_batch(backend, rows, repeats)))
    return points


def measure_deep_prefill(backend: Backend, seq: int, n_batch: int, repeats: int) -> list[Measurement]:
    """Chunks resumed at a deep position: what they attend to beyond themselves costs extra, and more again in a
    chunk shorter than the backend's prefill tile."""
    tile = backend.info.prefill_tile
    points = []
    done = 0
    backend.remove_seq(seq)
    for start in (s for s in DEEP_STARTS if s + max(DEEP_SIZES) <= backend.info.n_ctx_seq):
        while done < start:  # extend the prompt in KV up to this depth
            n = min(n_batch, start - done)
            pos = np.arange(done, done + n, dtype=np.int32)
            backend.decode((1000 + pos).astype(np.int32), pos, np.full(n, seq, np.int32), np.zeros(n, np.int8))
            done += n
        for size in (s for s in DEEP_SIZES if s <= n_batch):
            seconds = time_batch(backend, [(seq, p) for p in range(start, start + size)], repeats)
            deep = chunk_kv_tokens(size, start)
            points.append(Measurement(TickTerms(size, 0, 0, deep, deep if size < tile else 0), seconds))
    backend.remove_seq(seq)
    return points


def chars_per_token(backend: Backend, texts: Sequence[str]) -> float:
    """Characters per token of the model's tokenizer over `texts` (special tokens not counted)."""
    n_chars = sum(map(len, texts))
    n_tokens = sum(len(backend.tokenize(text, add_special=False)) for text in texts)
    if n_tokens == 0:
        raise ValueError("--text-sample holds no text to tokenize")
    return n_chars / n_tokens


def format_profile(profile: CostProfile) -> str:
    lines = [f"{'prefill':>8}{'at':>6}{'decode':>8}{'kv':>8}{'measured ms':>13}{'model ms':>10}{'tok/s':>9}"]
    for m in profile.measurements:
        rate = (m.terms.prefill_tokens + m.terms.decode_rows) / m.seconds
        n = m.terms.prefill_tokens
        depth = (m.terms.prefill_kv_tokens - chunk_kv_tokens(n, 0)) // n if n else 0
        lines.append(f"{m.terms.prefill_tokens:>8}{depth:>6}{m.terms.decode_rows:>8}{m.terms.decode_kv_tokens:>8}"
                     f"{m.seconds * 1e3:>13.1f}{profile.predict(m.terms) * 1e3:>10.1f}{rate:>9.1f}")
    lines.append(f"fit: tick = {profile.t0_s * 1e3:.2f} ms + {profile.prefill_s_per_token * 1e3:.3f} ms/prefill token"
                 f" + {profile.decode_s_per_row * 1e3:.3f} ms/decode row"
                 f" + {profile.decode_s_per_kv_token * 1e6:.3f} us/decode KV token"
                 f" + {profile.prefill_s_per_kv_token * 1e6:.3f} us/prefill token per position of depth"
                 f" (+ {profile.short_chunk_s_per_kv_token * 1e6:.3f} in a chunk below the prefill tile)")
    lines.append(f"tokenizer: {profile.chars_per_token:.2f} characters per token")
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("calibrate", help="measure the backend and save a cost profile (JSON)")
    add_backend_args(parser)
    parser.add_argument("--out", default=None,
                        help="where to write the profile (default: calibrated.json in the user's cache, "
                             "$COBALI_CACHE/profiles or ~/.cache/cobali/profiles; use it as --profile calibrated)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timings per point (the median is kept)")
    parser.add_argument("--text-sample", default="mixed_length",
                        help="prompts file or scenario whose text measures the tokenizer's characters per token")
    parser.set_defaults(func=calibrate_command)


def calibrate_command(args: argparse.Namespace) -> int:
    # One more sequence than slots: prefill chunks are timed on it, beside full decodes.
    config = backend_config(args, n_seq_max=args.max_slots + 1)
    texts = [item.prompt for item in load_items(args.text_sample, flag="--text-sample") if isinstance(item.prompt, str)]
    backend = build_backend(config)
    info = backend.info
    print(f"calibrating {info.description}: n_batch {info.n_batch}, {info.n_seq_max} sequences")
    time_batch(backend, [(0, p) for p in range(min(64, info.n_batch))], 1)  # warm-up
    points = measure(backend, info.n_seq_max, info.n_batch, args.repeats)
    profile = CostProfile.fit(points, device=info.description, source="cobali calibrate",
                              chars_per_token=chars_per_token(backend, texts))
    print(format_profile(profile))
    out = args.out or user_profiles_dir() / "calibrated.json"
    profile.save(out)
    print(f"wrote {out}")
    return 0
