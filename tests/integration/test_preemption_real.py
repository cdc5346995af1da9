"""Optimistic admission on a tiny unified KV: requests are preempted, recomputed, and still finish
with the greedy tokens of a roomy-context run.

Exact equality of every token is proven on the fake backend (tests/unit/test_kv.py). On the real model,
a unified KV's attention sums over cells in buffer order, and preemption moves the other sequences'
cells, so near-tied logits can flip late in a 128-token greedy run (measured: 4 of 8 requests diverge,
all after token 80, and unified 2048 vs 4096 cells agree exactly). The test therefore requires a long
common prefix for every request and exact equality for most.
"""

from __future__ import annotations

from cobali.backends.base import SamplingParams
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.engine.engine import Engine, EngineConfig
from cobali.engine.request import FinishReason

PROMPTS = [
    f"Story {i}: write a long and detailed story about a {animal} who travels to {place} to find a lost "
    f"treasure, describing every day of the journey, the weather, the food and the friends met on the way."
    for i, (animal, place) in enumerate(zip(
        ["fox", "bear", "owl", "cat", "wolf", "horse", "rabbit", "eagle"],
        ["Paris", "the mountains", "the sea", "a desert", "the moon", "Rome", "an island", "a forest"],
        strict=True))
]
PARAMS = SamplingParams(max_tokens=128, ignore_eos=True)


def run(model_path: str, n_ctx: int) -> tuple[list, int]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_ctx=n_ctx, n_seq_max=8, n_batch=256, kv_unified=True))
    try:
        engine = Engine(backend, EngineConfig(max_slots=8, n_batch=256, kv_admission="optimistic"))
        return engine.generate(PROMPTS, PARAMS), engine.scheduler.preemptions
    finally:
        backend.close()


def test_tiny_context_preempts_and_matches_roomy_run(model_path: str) -> None:
    tight, preemptions = run(model_path, 1024)
    roomy, none = run(model_path, 8 * 256)
    assert none == 0 and preemptions > 0
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_tokens) == 128 for r in tight)
    common = [_common_prefix(a.output_tokens, b.output_tokens) for a, b in zip(tight, roomy, strict=True)]
    assert min(common) >= 64, f"tokens in common with the roomy run: {common}"
    assert sum(n == 128 for n in common) >= len(PROMPTS) // 2, f"tokens in common with the roomy run: {common}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
