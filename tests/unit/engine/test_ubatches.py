"""The model of llama.cpp's micro-batch split (cobali/engine/ubatches.py): worked cases, and random batches
against a row-by-row transcription of llama.cpp's split_equal and split_simple (src/llama-batch.cpp).
tests/integration/test_ubatches_real.py checks it against llama.cpp's own graph computes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cobali.engine.plan import Chunk, ChunkKind, Plan
from cobali.engine.ubatches import SeqRows, count_passes, logits_rows_copied, plan_rows, split_batch


def decode_rows(*seq_ids: int) -> list[SeqRows]:
    return [SeqRows(s, 1, 1) for s in seq_ids]


def shapes(rows: list[SeqRows], n_ubatch: int = 512, per_seq_streams: bool = True) -> list[list[tuple[int, int]]]:
    """Each micro-batch as (seq id, rows) pairs."""
    return [[(r.seq_id, r.n_tokens) for r in u.rows] for u in split_batch(rows, n_ubatch, per_seq_streams)]


def test_decode_rows_in_consecutive_slots_are_one_pass() -> None:
    assert shapes(decode_rows(*range(16))) == [[(s, 1) for s in range(16)]]


def test_every_break_in_the_slots_run_is_one_more_pass() -> None:
    assert shapes(decode_rows(0, 1, 2, 5, 6, 9)) == [[(0, 1), (1, 1), (2, 1)], [(5, 1), (6, 1)], [(9, 1)]]


def test_a_prompt_chunk_after_the_decode_rows_runs_its_first_row_with_them() -> None:
    rows = [*decode_rows(0, 1, 2), SeqRows(3, 100, 1)]
    ubatches = split_batch(rows, 512, True)
    assert shapes(rows) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(3, 99)]]
    assert [u.n_outputs for u in ubatches] == [3, 1]


def test_a_prompt_chunk_in_a_gap_starts_its_own_runs() -> None:
    # 0 1 2 [3 x50] 5 6: the decode run stops at 3, whose chunk then runs alone, then 5 and 6.
    rows = [*decode_rows(0, 1, 2), SeqRows(3, 50, 1), *decode_rows(5, 6)]
    assert shapes(rows) == [[(0, 1), (1, 1), (2, 1), (3, 1)], [(3, 49)], [(5, 1), (6, 1)]]


def test_chunks_of_different_lengths_take_the_shortest_ones_rows_each_pass() -> None:
    assert shapes([SeqRows(0, 30, 1), SeqRows(1, 50, 1)]) == [[(0, 30), (1, 30)], [(1, 20)]]


def test_rows_per_sequence_stop_where_another_round_would_pass_n_ubatch() -> None:
    rows = [SeqRows(s, 200, 1) for s in range(4)]
    assert shapes(rows) == [[(s, 128) for s in range(4)], [(s, 72) for s in range(4)]]
    assert count_passes([SeqRows(0, 600, 1)], 512, True) == 2


@pytest.mark.parametrize("chunk_slots", [[10], [13], [3], [10, 11, 12], [13, 14], [0, 1]])
def test_one_run_of_decode_rows_and_one_of_equal_chunks_are_two_passes(chunk_slots: list[int]) -> None:
    decoding = [s for s in range(3, 10) if s not in chunk_slots]
    rows = sorted([*decode_rows(*decoding), *(SeqRows(s, 40, 1) for s in chunk_slots)])
    assert count_passes(rows, 512, True) == 2
    assert count_passes([*rows, SeqRows(15, 41, 1)], 512, True) == 3  # one more chunk, of another length


def test_the_scan_follows_the_batch_order_not_the_seq_ids() -> None:
    assert shapes(decode_rows(5, 3, 4)) == [[(5, 1)], [(3, 1), (4, 1)]]


def test_one_kv_stream_cuts_the_batch_every_n_ubatch_rows() -> None:
    rows = [*decode_rows(0, 7, 3), SeqRows(9, 100, 1), SeqRows(2, 30, 30)]
    assert count_passes(rows, 512, per_seq_streams=False) == 1
    assert shapes(rows, 64, per_seq_streams=False) == [[(0, 1), (7, 1), (3, 1), (9, 61)], [(9, 39), (2, 25)],
                                                        [(2, 5)]]
    assert [u.n_outputs for u in split_batch(rows, 64, False)] == [3, 1 + 25, 5]


def test_logits_are_copied_for_every_output_row_of_a_pass_with_one_not_sampled_on_the_device() -> None:
    rows = [*decode_rows(0, 1, 2, 3), SeqRows(4, 40, 1)]  # passes: 0..4 one row each, then 4's other 39
    ubatches = split_batch(rows, 512, True)
    assert logits_rows_copied(ubatches) == 5
    assert logits_rows_copied(ubatches, sampled_on_device={0, 1, 2, 3, 4}) == 0
    assert logits_rows_copied(ubatches, sampled_on_device={0, 1, 2, 3}) == 1  # only the prompt's pass
    assert logits_rows_copied(ubatches, sampled_on_device={0, 1, 2, 4}) == 4  # the decode pass, all its rows


def test_a_plans_rows_are_its_chunks_by_slot() -> None:
    chunks = (Chunk(1, 4, ChunkKind.PREFILL, 0, 64, 100, False), Chunk(0, 2, ChunkKind.DECODE, 9, 3, 12, True),
              Chunk(2, 3, ChunkKind.PREFILL, 64, 36, 100, True))
    assert plan_rows(Plan(0, chunks)) == [SeqRows(2, 3, 3), SeqRows(3, 36, 1), SeqRows(4, 64, 0)]


def test_a_sequence_split_over_the_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        split_batch([SeqRows(0, 1), SeqRows(1, 1), SeqRows(0, 1)], 512, True)


# ---- against a row-by-row transcription of llama.cpp ---------------------------------------------------


def llama_split(seq_of_row: list[int], output: list[bool], n_ubatch: int, per_seq_streams: bool) -> list[list]:
    """llama_batch_allocr::split_equal(n_ubatch, sequential=true) or split_simple, row by row; each micro-batch
    as its (seq id, rows, outputs) per sequence."""
    used = [False] * len(seq_of_row)
    ubatches = []
    while not all(used):
        if per_seq_streams:
            run: list[int] = []
            for i, seq in enumerate(seq_of_row):
                if not used[i] and seq not in run and (not run or seq == run[-1] + 1):
                    run.append(seq)
                    if len(run) > n_ubatch:
                        break
            per_seq = {s: [i for i, q in enumerate(seq_of_row) if q == s and not used[i]] for s in run}
            idxs: dict[int, list[int]] = {s: [] for s in run}
            while all(len(idxs[s]) < len(per_seq[s]) for s in run):
                for s in run:
                    idxs[s].append(per_seq[s][len(idxs[s])])
                if (len(idxs[run[0]]) + 1) * len(run) > n_ubatch:
                    break
            picked = [i for s in run for i in idxs[s]]
        else:
            picked = [i for i, u in enumerate(used) if not u][:n_ubatch]
        for i in picked:
            used[i] = True
        ubatch: list[list[int]] = []
        for i in picked:
            if not ubatch or ubatch[-1][0] != seq_of_row[i]:
                ubatch.append([seq_of_row[i], 0, 0])
            ubatch[-1][1] += 1
            ubatch[-1][2] += output[i]
        ubatches.append([tuple(part) for part in ubatch])
    return ubatches


@st.composite
def batches(draw) -> list[SeqRows]:
    seqs = draw(st.lists(st.integers(0, 11), min_size=1, max_size=10, unique=True))
    if draw(st.booleans()):
        seqs.sort()
    rows = []
    for seq in seqs:
        n = draw(st.sampled_from([1, 1, 1, 2, 5, 17, 64, 100]))
        rows.append(SeqRows(seq, n, draw(st.sampled_from([0, 1, n]))))
    return rows


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batches(), st.sampled_from([4, 16, 64, 512]), st.booleans())
def test_the_model_splits_as_llama_cpp_does_row_by_row(rows: list[SeqRows], n_ubatch: int,
                                                       per_seq_streams: bool) -> None:
    seq_of_row = [r.seq_id for r in rows for _ in range(r.n_tokens)]
    output = [j >= r.n_tokens - r.n_outputs for r in rows for j in range(r.n_tokens)]
    modelled = [[tuple(part) for part in u.rows] for u in split_batch(rows, n_ubatch, per_seq_streams)]
    assert modelled == llama_split(seq_of_row, output, n_ubatch, per_seq_streams)
