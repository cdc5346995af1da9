"""A model-free backend whose decode calls take virtual time from a cost profile.

SimBackend is the FakeBackend (same deterministic logits, same strict KV bookkeeping, same tokenizer
for token-id prompts) with two changes: each decode advances a VirtualClock by the profile's predicted
tick time, and the bookkeeping is incremental (the fake copies every sequence's KV and keeps every batch
per call, which is quadratic over a long simulation). The engine runs unchanged on it:

    backend = SimBackend(profile, n_seq_max=16)
    engine = Engine(backend, config, clock=backend.clock)
"""

from __future__ import annotations

import numpy as np

from cobali.backends.base import DecodeError
from cobali.backends.fake import Batch, FakeBackend
from cobali.engine.costs import CostModel, TickTerms, chunk_kv_tokens


class VirtualClock:
    """Seconds since the simulation began; moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)


class SimBackend(FakeBackend):
    def __init__(self, costs: CostModel, clock: VirtualClock | None = None, *, n_seq_max: int = 16,
                 n_ctx_seq: int = 2048, n_batch: int = 512, kv_unified: bool = False, n_vocab: int = 96,
                 chars_per_token: float = 1.0, prefill_tile: int = 1) -> None:
        super().__init__(n_seq_max=n_seq_max, n_ctx_seq=n_ctx_seq, n_batch=n_batch, kv_unified=kv_unified,
                         n_vocab=n_vocab, prefill_tile=prefill_tile)
        self.costs = costs
        self.clock = clock or VirtualClock()
        # Text prompts: the fake makes one token per character, several times what a BPE vocabulary makes of
        # English; grouping characters (as many per token as the profiled model's tokenizer takes) keeps
        # simulated prompt lengths realistic.
        self.chars_per_token = chars_per_token
        self.n_calls = 0
        self.busy_s = 0.0
        self.slowdown = 1.0  # the next ticks take this many times the profile's time (cobali.sim.host)
        self._vocab = np.arange(n_vocab, dtype=np.float32)

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        n = len(tokens)
        assert 0 < n <= self.n_batch, f"batch of {n} rows exceeds n_batch {self.n_batch}"
        call, self.n_calls = self.n_calls, self.n_calls + 1
        if call in self.fail_on_calls:
            what = "no KV slot for the batch" if self.fail_code == 1 else "injected failure"
            raise DecodeError(f"{what} (decode call {call})", code=self.fail_code)
        toks, pos, seqs = tokens.tolist(), positions.tolist(), seq_ids.tolist()
        want = want_logits.astype(bool).tolist()
        runs, seconds = self._plan_runs(seq_ids, pos)
        seconds *= self.slowdown
        for start, end, seq in runs:
            self.kv[seq].extend(toks[start:end])
        # Only the last batch is kept: the fake's non-greedy sampler reads its want_logits.
        self.batches = [Batch(tuple(toks), tuple(pos), tuple(seqs), tuple(want))]
        self.last_logits = self._logits(pos, seqs, want)
        self.busy_s += seconds
        self.clock.advance(seconds)
        return self.last_logits

    def _plan_runs(self, seq_ids: np.ndarray, pos: list[int]) -> tuple[list[tuple[int, int, int]], float]:
        """Split rows into runs of one sequence, each continuing its sequence's KV exactly; check that
        they fit; price the batch. Raises DecodeError (no KV slot) before any KV changes."""
        n = len(pos)
        cuts = (np.flatnonzero(seq_ids[1:] != seq_ids[:-1]) + 1).tolist()
        steps = np.diff(np.asarray(pos))
        steps[[c - 1 for c in cuts]] = 1  # a new run may start anywhere; within a run positions step by 1
        assert (steps == 1).all(), f"rows skip or repeat positions within a sequence: {pos}"
        starts = [0, *cuts]
        runs = list(zip(starts, [*cuts, n], seq_ids[starts].tolist(), strict=True))
        next_pos: dict[int, int] = {}
        decode_rows = kv_tokens = prefill_kv_tokens = short_kv_tokens = 0
        for start, end, seq in runs:
            first = next_pos.get(seq)
            if first is None:
                first = len(self.kv[seq])
            assert pos[start] == first, f"seq {seq}: row at pos {pos[start]}, but KV holds {first} tokens"
            next_pos[seq] = first + end - start
            if end - start == 1:  # a decode row (a 1-token prefill chunk is rare and costs about the same)
                decode_rows += 1
                kv_tokens += first + 1
            else:
                deep = chunk_kv_tokens(end - start, first)
                prefill_kv_tokens += deep
                if end - start < self.prefill_tile:  # attended row by row: costs more per position of depth
                    short_kv_tokens += deep
        if self.kv_unified:
            fits = sum(map(len, self.kv.values())) + n <= self.info.n_ctx
        else:
            fits = max(next_pos.values()) <= self.n_ctx_seq
        if not fits:
            raise DecodeError("no KV slot for the batch", code=1)
        terms = TickTerms(n - decode_rows, decode_rows, kv_tokens, prefill_kv_tokens, short_kv_tokens)
        return runs, self.costs.predict(terms)

    def _logits(self, pos: list[int], seqs: list[int], want: list[bool]) -> np.ndarray:
        """The fake's logits (a peak at a target set by the last 3 tokens and the length), vectorized."""
        targets = []
        for row in (r for r, w in enumerate(want) if w):
            length = pos[row] + 1
            history = self.kv[seqs[row]]
            targets.append((sum(history[max(0, length - 3):length]) * 7 + length * 13) % self.n_vocab)
        peaks = np.asarray(targets, dtype=np.float32)[:, None]
        return -0.5 * np.abs(self._vocab[None, :] - peaks)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        per_char = super().tokenize(text, add_special)
        if self.chars_per_token == 1 or not per_char:
            return per_char
        groups = np.array_split(np.asarray(per_char), max(1, round(len(per_char) / self.chars_per_token)))
        # Ids stay in [1, n_vocab): 0 is the fake's end-of-generation token.
        return [int(group.sum()) % (self.n_vocab - 1) + 1 for group in groups]
