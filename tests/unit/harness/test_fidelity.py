"""The fidelity criterion on the fake backend, whose logits depend only on a sequence's own KV: any correct
schedule is identical to the reference, and a planted bug diverges at a clear margin."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.harness.fidelity import Trace, compare, compare_runs, greedy_traces
from cobali.harness.workloads import WorkItem

ITEMS = [WorkItem([1 + (s * 7 + i * 3) % 90 for i in range(10 + 9 * s)], 12) for s in range(6)]
# The fake's logits fall by 0.5 a token away from its target, so its top-1 minus top-2 margin is 0.5 at
# every step; these tests judge at a lower epsilon than the real model's.
FAKE_EPSILON = 0.25


class SwappedRows:
    """A planted bug: the sampler reads the row of the batch's next request (the first two rows swapped)."""

    def __init__(self, inner: FakeBackend) -> None:
        self.inner = inner
        self.info = inner.info

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, tokens, positions, seq_ids, want_logits) -> np.ndarray:
        logits = self.inner.decode(tokens, positions, seq_ids, want_logits).copy()
        if len(logits) >= 2:
            logits[[0, 1]] = logits[[1, 0]]
        return logits


def traces(backend, mode: str, slots: int, chunk: int) -> list[Trace]:
    config = EngineConfig(mode=mode, max_slots=slots, n_batch=64, prefill_chunk_tokens=chunk)
    return greedy_traces(Engine(backend, config), ITEMS, 12)


@pytest.fixture(scope="module")
def reference() -> list[Trace]:
    return traces(FakeBackend(n_seq_max=1, n_batch=64), "seq", 1, 64)


def test_a_correct_schedule_is_identical(reference: list[Trace]) -> None:
    report = compare_runs(reference, traces(FakeBackend(n_seq_max=4, n_batch=64), "cont", 4, 8), FAKE_EPSILON)
    assert report.n_identical == len(ITEMS) and report.passed and report.mostly_common, report.describe()
    assert all(len(t.margins) == len(t.tokens) == 12 for t in reference)


def test_a_sampler_reading_the_wrong_row_is_flagged(reference: list[Trace]) -> None:
    buggy = SwappedRows(FakeBackend(n_seq_max=4, n_batch=64))
    report = compare_runs(reference, traces(buggy, "cont", 4, 8), FAKE_EPSILON)
    assert not report.passed and report.flagged, report.describe()
    assert report.max_margin == pytest.approx(0.5, abs=1e-6)


def test_compare_finds_the_first_divergence_and_its_margins() -> None:
    reference = Trace((5, 6, 7, 8), (2.0, 0.1, 3.0, 1.0))
    candidate = Trace((5, 6, 9, 8), (2.0, 0.1, 0.2, 1.0))
    result = compare(3, reference, candidate)
    assert (result.index, result.divergence, result.common) == (3, 2, 2)
    assert (result.reference_margin, result.candidate_margin) == (3.0, 0.2)
    assert compare(0, reference, reference).identical


def test_near_ties_pass_and_clear_margins_or_failures_do_not() -> None:
    reference = [Trace((1, 2, 3, 4), (1.0, 1.0, 1.0, 1.0)), Trace((1, 2, 3, 4), (1.0, 0.05, 1.0, 1.0))]
    near_tie = [Trace((1, 2, 3, 4), (1.0, 1.0, 1.0, 1.0)), Trace((1, 9, 3, 4), (1.0, 0.04, 1.0, 1.0))]
    report = compare_runs(reference, near_tie, epsilon=0.5)
    assert report.passed and report.max_margin == 0.05 and report.n_identical == 1
    assert not compare_runs(reference, [reference[0], Trace((1, 2, 9, 4), (1, 1, 1, 1))], epsilon=0.5).passed
    failed = compare_runs(reference, [reference[0], Trace((1,), (1.0,), error="decode failed")], epsilon=0.5)
    assert not failed.passed and failed.errors
    short = compare_runs(reference, [reference[0], Trace((1, 2), (1.0, 1.0))], epsilon=0.5)
    assert not short.passed and "generated 2 tokens" in short.errors[0]


def test_early_divergences_at_near_ties_pass_but_leave_little_in_common() -> None:
    reference = [Trace((1, 2, 3, 4), (0.01, 1.0, 1.0, 1.0))] * 3
    early = [Trace((7, 2, 3, 4), (0.01, 1.0, 1.0, 1.0))] * 3
    report = compare_runs(reference, early, epsilon=0.5)
    assert report.passed and report.common_fraction == 0 and not report.mostly_common
