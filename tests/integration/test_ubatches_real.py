"""The micro-batch model (cobali/engine/ubatches.py) against llama.cpp itself, on the embedded model: the
forward passes each decode runs (graph computes, counted by an eval callback) and the logits rows it copies to
the host, with per-sequence KV streams and with a unified KV, with and without greedy tokens picked in the
graph; then per tick through the engine."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.ubatches import SeqRows, count_passes, logits_rows_copied, plan_rows, split_batch
from cobali.frontend.offline import LLM

N_BATCH = 128  # = n_ubatch: cobali makes its contexts so (loading.new_context)


def decode_rows(*seq_ids: int) -> list[SeqRows]:
    return [SeqRows(s, 1, 1) for s in seq_ids]


MIXES = {
    "decode rows": decode_rows(0, 1, 2, 3, 4, 5),
    "decode rows and a prompt chunk": [*decode_rows(0, 1, 2, 3), SeqRows(4, 40, 1)],
    "two prompt chunks of different lengths": [SeqRows(0, 30, 1), SeqRows(1, 50, 1)],
    "non-consecutive seq ids": [*decode_rows(0, 1, 3, 6), SeqRows(7, 20, 1)],
    "a prompt chunk in a gap between decode rows": [*decode_rows(0, 1), SeqRows(2, 33, 1), *decode_rows(5, 6)],
    "seq ids out of order": decode_rows(2, 0, 1),
    "prompt logprobs: every row of a chunk read": [*decode_rows(0, 1), SeqRows(2, 25, 25), SeqRows(3, 9, 1)],
}


def make_backend(model_path: str, **options) -> LlamaCppBackend:
    return LlamaCppBackend(LlamaCppConfig(model_path, n_ctx=8 * 256, n_seq_max=8, n_batch=N_BATCH, n_threads=2,
                                          count_decodes=True, **options))


@pytest.fixture(scope="module", params=[False, True], ids=["kv streams", "unified kv"])
def backend(request, model_path: str):
    backend = make_backend(model_path, kv_unified=request.param)
    # Grow llama.cpp's output buffer to the most rows a mix reads before any mix is counted: a buffer grown
    # during a counted decode may land at the same address, and then the counter cannot tell its rows apart
    # (raw_logits_rows None, counters.py). Where the allocator puts it differs between machines.
    most_outputs = max(sum(r.n_outputs for r in rows) for rows in MIXES.values())
    decode(backend, [SeqRows(0, most_outputs, most_outputs)])
    yield backend
    backend.close()


def decode(backend: LlamaCppBackend, rows: list[SeqRows], argmax_seqs: frozenset[int] = frozenset()):
    """Decode the rows from position 0 of each sequence, then empty them; llama.cpp's counts of that decode."""
    wants = [(WANT_ARGMAX if r.seq_id in argmax_seqs else WANT_LOGITS) * int(j >= r.n_tokens - r.n_outputs)
             for r in rows for j in range(r.n_tokens)]
    tokens = np.array([200 + j % 50 for r in rows for j in range(r.n_tokens)], dtype=np.int32)
    positions = np.array([j for r in rows for j in range(r.n_tokens)], dtype=np.int32)
    seq_ids = np.array([r.seq_id for r in rows for _ in range(r.n_tokens)], dtype=np.int32)
    backend.decode(tokens, positions, seq_ids, np.array(wants, dtype=np.int8))
    for r in rows:
        backend.remove_seq(r.seq_id)
    return backend.decode_counts[-1]


@pytest.mark.parametrize("mix", MIXES)
def test_llama_cpp_runs_the_passes_and_copies_the_logits_rows_the_model_says(backend, mix: str) -> None:
    rows = MIXES[mix]
    counts = decode(backend, rows)
    ubatches = split_batch(rows, N_BATCH, per_seq_streams=not backend.options.kv_unified)
    assert counts.passes == len(ubatches)
    assert counts.raw_logits_rows == logits_rows_copied(ubatches) == sum(r.n_outputs for r in rows)


def test_a_decode_shaped_like_the_last_reuses_its_graph(backend) -> None:
    before = backend.graphs_reused()
    decode(backend, decode_rows(0, 1, 2))
    counts = decode(backend, decode_rows(0, 1, 2))
    assert counts.graphs_reused == counts.passes == 1
    assert backend.graphs_reused() >= before + 1


def test_the_context_runs_micro_batches_of_n_batch_rows(backend) -> None:
    import llama_cpp as ll

    assert ll.llama_n_ubatch(backend.ctx) == backend.info.n_batch == N_BATCH


@pytest.fixture(scope="module")
def sampling_backend(model_path: str):
    backend = make_backend(model_path, backend_sampling=True)
    yield backend
    backend.close()


@pytest.mark.parametrize(("rows", "argmax_seqs"), [
    (decode_rows(0, 1, 2, 3), {0, 1, 2, 3}),  # every output row picked in the graph: no logits copied
    (decode_rows(0, 1, 2, 3), {0, 1, 3}),  # one row read on the host: its whole pass copied
    ([*decode_rows(0, 1, 2, 3), SeqRows(4, 40, 1)], {0, 1, 2, 3}),  # the prompt's pass copied, not the decodes'
    ([*decode_rows(0, 1), SeqRows(3, 20, 1), *decode_rows(4, 5)], {0, 1, 4, 5}),
], ids=["all picked", "one host row", "a prompt on the host", "a prompt in a gap"])
def test_rows_picked_in_the_graph_copy_logits_where_the_model_says(sampling_backend, rows: list[SeqRows],
                                                                   argmax_seqs: set[int]) -> None:
    counts = decode(sampling_backend, rows, frozenset(argmax_seqs))
    ubatches = split_batch(rows, N_BATCH, per_seq_streams=True)
    assert counts.passes == len(ubatches)
    assert counts.raw_logits_rows == logits_rows_copied(ubatches, argmax_seqs)
    # The token-only chain drops each picked row's logits from the graph's outputs: none is copied into
    # llama.cpp's sampling buffer (test_backend_sampling_real.py: llama.cpp's greedy sampler alone copies them).
    assert counts.sampled_logits_rows == 0


def test_every_tick_of_the_engine_runs_the_passes_of_its_plan(model_path: str) -> None:
    backend = make_backend(model_path)
    engine = Engine(backend, EngineConfig(mode="cont", max_slots=8, n_batch=N_BATCH, prefill_chunk_tokens=24))
    prompts = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3) for i in range(10)]
    LLM(engine).generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    counts = backend.decode_counts
    backend.close()
    assert len(counts) == len(engine.ticks)
    modelled = [count_passes(plan_rows(t.plan), N_BATCH, per_seq_streams=True) for t in engine.ticks]
    assert [c.passes for c in counts] == modelled
    assert max(modelled) > 1  # the workload has ticks of several passes
