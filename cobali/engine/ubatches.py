"""How llama.cpp cuts one batch into micro-batches, each one forward pass (one graph compute), and which
logits rows it then copies to the host: a pure model of the llama.cpp that llama-cpp-python 0.3.36 vendors,
checked against its own graph computes by tests/integration/test_ubatches_real.py.

Which split runs is the KV cache's choice (`llama_kv_cache::init_batch`, src/llama-kv-cache.cpp):
- one KV stream (a unified KV, or a context of one sequence): `split_simple`, the batch's rows in order,
  n_ubatch at a time, whatever their sequences;
- a stream per sequence (cobali's default): `split_equal(sequential=true)` (src/llama-batch.cpp). Each
  micro-batch is a run of consecutive seq ids with rows left, found by scanning the batch in row order from
  its first row not yet taken, taking as many rows from each sequence as the shortest has left (at most
  n_ubatch in all). So decode rows in consecutive slots share one pass, and a tick with prompt chunks runs in
  two when its decode rows make one run of slots and its chunks, all of one length, make another or join it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from cobali.engine.plan import ChunkKind, Plan


class SeqRows(NamedTuple):
    """One sequence's rows of a batch, contiguous in it; the last n_outputs of them want logits."""

    seq_id: int
    n_tokens: int
    n_outputs: int = 0


class Ubatch(NamedTuple):
    """One micro-batch: the rows it takes from each sequence, in its row order."""

    rows: tuple[SeqRows, ...]

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows)

    @property
    def n_outputs(self) -> int:
        return sum(r.n_outputs for r in self.rows)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(r.seq_id for r in self.rows)


def split_batch(rows: Sequence[SeqRows], n_ubatch: int, per_seq_streams: bool) -> list[Ubatch]:
    """The micro-batches llama.cpp runs for a batch of these rows, in order. `per_seq_streams`: the context has
    a KV stream per sequence (kv_unified off and n_seq_max > 1)."""
    if n_ubatch < 1:
        raise ValueError(f"n_ubatch must be >= 1, got {n_ubatch}")
    seq_ids = [r.seq_id for r in rows]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"each sequence's rows must be contiguous in the batch: seq ids {seq_ids}")
    if any(r.n_tokens < 1 or not 0 <= r.n_outputs <= r.n_tokens for r in rows):
        raise ValueError(f"every sequence needs >= 1 row and at most as many outputs: {list(rows)}")
    return _split_equal(rows, n_ubatch) if per_seq_streams else _split_simple(rows, n_ubatch)


def count_passes(rows: Sequence[SeqRows], n_ubatch: int, per_seq_streams: bool) -> int:
    return len(split_batch(rows, n_ubatch, per_seq_streams))


def plan_rows(plan: Plan) -> list[SeqRows]:
    """A plan's batch as the engine fills it (Plan.rows order). A decode chunk reads every row (its token and
    any guesses behind it), a prefill chunk its last row when it yields a token; a chunk asking for prompt
    logprobs reads all of its rows, which a plan does not say (that changes the logits model, not the split)."""
    return [SeqRows(c.slot, c.n_tokens, c.n_tokens if c.kind is ChunkKind.DECODE else int(c.yields_token))
            for c in plan.rows]


def logits_rows_copied(ubatches: Sequence[Ubatch], sampled_on_device: Collection[int] = ()) -> int:
    """Logits rows llama.cpp copies to the host (`needs_raw_logits`, src/llama-context.cpp): all the output rows
    of a micro-batch where any output row is of a sequence without a backend sampler, none of any other."""
    return sum(u.n_outputs for u in ubatches
               if any(r.n_outputs and r.seq_id not in sampled_on_device for r in u.rows))


def _split_simple(rows: Sequence[SeqRows], n_ubatch: int) -> list[Ubatch]:
    ubatches: list[Ubatch] = []
    current: list[SeqRows] = []
    room = n_ubatch
    for row in rows:
        taken = 0
        while taken < row.n_tokens:
            k = min(room, row.n_tokens - taken)
            current.append(_part(row, taken, k))
            taken, room = taken + k, room - k
            if room == 0:
                ubatches.append(Ubatch(tuple(current)))
                current, room = [], n_ubatch
    if current:
        ubatches.append(Ubatch(tuple(current)))
    return ubatches


def _split_equal(rows: Sequence[SeqRows], n_ubatch: int) -> list[Ubatch]:
    taken = [0] * len(rows)
    ubatches = []
    while run := _consecutive_run(rows, taken, n_ubatch):
        left = min(rows[i].n_tokens - taken[i] for i in run)
        # Rows from each until one sequence runs out or another round would pass n_ubatch; one at least.
        k = min(left, max(1, n_ubatch // len(run)))
        ubatches.append(Ubatch(tuple(_part(rows[i], taken[i], k) for i in run)))
        for i in run:
            taken[i] += k
    return ubatches


def _consecutive_run(rows: Sequence[SeqRows], taken: list[int], n_ubatch: int) -> list[int]:
    """Indices of the sequences the next micro-batch takes rows from: scanning in row order, the first with
    rows left, then each with rows left whose seq id is one more than the last taken."""
    run: list[int] = []
    for i, row in enumerate(rows):
        if taken[i] < row.n_tokens and (not run or row.seq_id == rows[run[-1]].seq_id + 1):
            run.append(i)
            if len(run) > n_ubatch:  # llama.cpp's bound, one past n_ubatch; never met when n_seq_max <= n_ubatch
                break
    return run


def _part(row: SeqRows, start: int, n: int) -> SeqRows:
    """Rows [start, start + n) of a sequence's rows, with the outputs among them."""
    first_output = row.n_tokens - row.n_outputs
    return SeqRows(row.seq_id, n, max(0, start + n - max(start, first_output)))
