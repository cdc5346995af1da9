"""Ticks laid out for llama.cpp's batch split: with per-sequence KV streams every tick runs in at most two
forward passes by the pure model of that split (engine/ubatches.py), whatever the prompts' lengths."""

from __future__ import annotations

import random

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import ChunkKind, Plan
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.ubatches import count_passes, plan_rows
from cobali.frontend.offline import LLM

SLOTS, N_BATCH, TILE = 16, 512, 65  # Table 2's cont: 16 slots, 512-token batches; llama.cpp's prefill tile


def make_engine(two_pass: bool, policy: str = "decode-max", queue: str = "fifo", unified: bool = False) -> Engine:
    backend = FakeBackend(n_seq_max=SLOTS, n_batch=N_BATCH, prefill_tile=TILE, kv_unified=unified)
    return Engine(backend, EngineConfig(max_slots=SLOTS, n_batch=N_BATCH, policy=policy, queue=queue,
                                        two_pass_ticks=two_pass))


def serve(engine: Engine, seed: int, n: int = 60) -> list[Request]:
    """prompts_186-like requests (random prompt and output lengths), half queued at once and half arriving over
    the following ticks."""
    rng = random.Random(seed)
    items = [([rng.randrange(1, 90) for _ in range(rng.randrange(8, 700))],
              SamplingParams(max_tokens=rng.randrange(1, 80), ignore_eos=True)) for _ in range(n)]
    requests = [engine.add_request(prompt, params) for prompt, params in items[: n // 2]]
    for prompt, params in items[n // 2:]:
        for _ in range(rng.randrange(0, 6)):
            engine.step()
        requests.append(engine.add_request(prompt, params))
    list(LLM(engine).run())
    return requests


def passes(plan: Plan, decodes_only: bool = False) -> int:
    rows = [r for r, c in zip(plan_rows(plan), plan.rows, strict=True)
            if not decodes_only or c.kind is ChunkKind.DECODE]
    return count_passes(rows, N_BATCH, per_seq_streams=True)


def within_two_passes(plan: Plan) -> bool:
    """Two passes at most, or, where gaps split the decode rows already (a slot freed this tick, a prompt waiting
    between them), at most one more than they take alone."""
    return passes(plan) <= max(2, passes(plan, decodes_only=True) + 1)


@pytest.mark.parametrize(("policy", "queue"), [("decode-max", "fifo"), ("balanced", "fifo"),
                                               ("decode-max", "srpf"), ("prefill-first", "fifo")])
@pytest.mark.parametrize("seed", range(4))
def test_every_tick_runs_in_two_passes_and_gives_the_same_outputs(policy: str, queue: str, seed: int) -> None:
    engine = make_engine(True, policy, queue)
    requests = serve(engine, seed)
    plans = [t.plan for t in engine.ticks]
    assert all(map(within_two_passes, plans)), [passes(p) for p in plans if not within_two_passes(p)]
    assert sum(p.n_prefill_tokens > 0 for p in plans) > 10
    old = serve(make_engine(False, policy, queue), seed)
    assert [r.output_tokens for r in requests] == [r.output_tokens for r in old]


def test_without_the_layout_mixed_ticks_take_more_passes() -> None:
    """The old layout: every chunk the budget allows, so prompt chunks of different lengths are peeled off in
    levels (the check above fails on it)."""
    engine = make_engine(False)
    serve(engine, 0)
    assert not all(within_two_passes(t.plan) for t in engine.ticks)


def test_the_layout_keeps_most_of_the_prefill_tokens_a_tick() -> None:
    """Cut to two passes, a mixed tick still carries most of what the budget allows: equal chunks in
    consecutive slots, or one long chunk."""
    def prefill_per_tick(engine: Engine) -> float:
        mixed = [t.plan.n_prefill_tokens for t in engine.ticks if t.plan.n_prefill_tokens]
        return sum(mixed) / len(mixed)

    on, off = make_engine(True), make_engine(False)
    serve(on, 1)
    serve(off, 1)
    assert prefill_per_tick(on) >= 0.5 * prefill_per_tick(off)


def test_a_unified_kv_keeps_every_chunk() -> None:
    """One KV stream: llama.cpp runs any tick in one pass, so nothing is laid out."""
    engine = make_engine(True, unified=True)
    assert engine._scheduler.layout is None
    serve(engine, 2)
    old = make_engine(False, unified=True)
    serve(old, 2)
    assert [t.plan.chunks for t in engine.ticks] == [t.plan.chunks for t in old.ticks]
