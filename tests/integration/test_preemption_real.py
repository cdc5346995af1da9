"""Optimistic admission on a tiny unified KV: requests are preempted, recomputed, and still finish
with the greedy tokens of a roomy-context run, up to floating-point noise.

Exact equality of every token is proven on the fake backend (tests/unit/engine/test_kv.py). On the real model, a
unified KV's attention sums over cells in buffer order, and preemption moves the other sequences' cells,
so near-tied logits can flip; how often depends on the CPU's kernels (4 of 8 requests diverged late on one
machine, 5 of 8 earlier on another). The test therefore judges by cobali.harness.fidelity: every divergence
must sit at a near-tie of the roomy run, and most tokens must be in common.
"""

from __future__ import annotations

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.harness.fidelity import Trace, compare_runs, greedy_traces
from cobali.harness.workloads import WorkItem

ITEMS = [
    WorkItem(f"Story {i}: write a long and detailed story about a {animal} who travels to {place} to find a lost "
             f"treasure, describing every day of the journey, the weather, the food and the friends met on the way.")
    for i, (animal, place) in enumerate(zip(
        ["fox", "bear", "owl", "cat", "wolf", "horse", "rabbit", "eagle"],
        ["Paris", "the mountains", "the sea", "a desert", "the moon", "Rome", "an island", "a forest"],
        strict=True))
]


def run(model_path: str, n_ctx: int) -> tuple[list[Trace], int]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_ctx=n_ctx, n_seq_max=8, n_batch=256, kv_unified=True))
    try:
        engine = Engine(backend, EngineConfig(max_slots=8, n_batch=256, kv_admission="optimistic"))
        return greedy_traces(engine, ITEMS, 128), engine._scheduler.preemptions
    finally:
        backend.close()


def test_tiny_context_preempts_and_matches_roomy_run(model_path: str) -> None:
    tight, preemptions = run(model_path, 1024)
    roomy, none = run(model_path, 8 * 256)
    assert none == 0 and preemptions > 0
    assert all(len(t.tokens) == 128 and t.error is None for t in tight)
    report = compare_runs(roomy, tight)
    assert report.passed and report.mostly_common, report.describe()
