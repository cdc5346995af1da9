"""The simulator routing by the KV (sim/routing.py) on conversations over shared contexts (sim/conversations.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from cobali.engine.costs import CostProfile
from cobali.engine.engine_config import EngineConfig
from cobali.faces.cli import main
from cobali.frontend.prefix_routing import RoutingConfig
from cobali.frontend.text_prefix_routing import TextRoutingConfig
from cobali.sim.cluster import SimItem, SimResult, SimSpec, simulate
from cobali.sim.conversations import ConversationShape, conversations
from cobali.sim.routers import PowerOfTwo, TokenWords

# Prefill-bound, as a long context is: 256 prompt tokens cost 0.26 s, a decode tick 2 ms.
COSTS = CostProfile(t0_s=0.001, prefill_s_per_token=0.001, decode_s_per_row=0.0002, decode_s_per_kv_token=0.0)
SPEC = SimSpec(COSTS, EngineConfig(max_slots=4, n_batch=256, host_cache_mib=0, record_ticks=False), n_ctx_seq=4096,
               kv_unified=True, replicas=4)
KV = RoutingConfig(block_tokens=16, report_period_s=0.5)
SHAPE = ConversationShape(customers=8, users_per_customer=2, turns=3, context_tokens=256, question_tokens=16,
                          answer_tokens=16, max_tokens=8, rate=6.0)


def test_conversations_grow_turn_by_turn_over_their_customers_context() -> None:
    items, arrivals = conversations(SHAPE, n_vocab=96, seed=3)
    assert len(items) == SHAPE.n_requests == 48 and np.all(np.diff(arrivals) >= 0)
    by_session: dict[str | None, list[list[int]]] = {}
    for item in items:
        by_session.setdefault(item.session, []).append(item.tokens)
        assert all(0 < t < 96 for t in item.tokens) and item.max_tokens == 8
    assert len(by_session) == 16 and all(len(turns) == 3 for turns in by_session.values())
    for session, turns in by_session.items():
        assert [len(t) for t in turns] == [272, 304, 336]
        assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(turns))
        customer = str(session).split("/")[0]
        assert turns[0][:256] == by_session[f"{customer}/0"][0][:256], "a customer's users share its context"
    assert by_session["0/0"][0][:16] != by_session["1/0"][0][:16]


def run(items: list[SimItem], arrivals: list[float],
        routing: RoutingConfig | TextRoutingConfig | PowerOfTwo | None) -> tuple[SimResult, dict]:
    result = simulate(items, arrivals, replace(SPEC, routing=routing))
    summary = result.summary()
    assert summary["unfinished"] == 0 and summary["failed"] == 0
    return result, summary


def test_routing_by_the_kv_reuses_the_contexts_that_routing_by_load_recomputes() -> None:
    items, arrivals = conversations(SHAPE, n_vocab=96)
    _, by_load = run(items, arrivals, None)
    _, by_kv = run(items, arrivals, KV)
    # The cold misses: each customer's context once, and a turn's question and answer; routed by load a customer's
    # users and turns spread over the replicas.
    assert by_kv["prefix_hit_rate"] > 0.65 > 0.45 > by_load["prefix_hit_rate"]  # of about 0.77 at best
    assert by_kv["ttft_p50_ms"] < 0.5 * by_load["ttft_p50_ms"]
    assert by_kv["router"] == "kv" and by_load["router"] == "least-tokens"
    # Reports come at arrivals, at most one per replica per period (or per arrival, when they come slower).
    assert 0 < by_kv["digest_reports"] <= 4 * min(by_kv["wall_s"] / 0.5 + 1, len(items))


def test_without_shared_prefixes_the_kv_router_loses_nothing_and_balances() -> None:
    rng = np.random.default_rng(0)
    items = [SimItem(rng.integers(1, 96, 300).tolist(), 8) for _ in range(48)]
    arrivals = np.cumsum(rng.exponential(1 / 6.0, 48)).tolist()
    # Against routing by load as a deployment can (Ray Serve's default: the router knows what it sent, not what
    # each replica has computed of it since).
    _, by_load = run(items, arrivals, PowerOfTwo())
    result, by_kv = run(items, arrivals, KV)
    assert by_kv["prefix_hit_rate"] == by_load["prefix_hit_rate"] == 0
    assert by_kv["ttft_mean_ms"] <= 1.1 * by_load["ttft_mean_ms"]
    routed = [r.routed for r in result.replicas]
    assert max(routed) <= 2 * min(routed), routed
    assert [r.routed_work for r in result.replicas] == [0] * len(result.replicas), "all finished: no work left"


def test_the_text_tree_reuses_contexts_and_spreads_prompts_that_share_nothing() -> None:
    items, arrivals = conversations(SHAPE, n_vocab=96)
    _, by_load = run(items, arrivals, PowerOfTwo())
    result, by_text = run(items, arrivals, TextRoutingConfig())
    assert by_text["prefix_hit_rate"] > 0.65 > 0.5 > by_load["prefix_hit_rate"]  # measured 0.74 and 0.44
    assert by_text["ttft_p50_ms"] < 0.5 * by_load["ttft_p50_ms"]
    assert by_text["router"] == "text" and by_load["router"] == "least-busy"
    rng = np.random.default_rng(0)
    unshared = [SimItem(rng.integers(1, 96, 300).tolist(), 8) for _ in range(48)]
    result, by_text = run(unshared, np.cumsum(rng.exponential(1 / 6.0, 48)).tolist(), TextRoutingConfig())
    routed = [r.routed for r in result.replicas]
    assert max(routed) <= 2 * min(routed), routed  # the smallest tree takes what matches nowhere


def test_token_words_keep_shared_token_prefixes_shared_text_prefixes() -> None:
    words = TokenWords(chars_per_token=4.45)
    assert words.text([1, 2, 3]) == "baa caa daa " and words.word(26**3 + 5) == "faab "
    assert len({words.word(t) for t in range(30_000)}) == 30_000
    assert words.text([7, 8, 9]).startswith(words.text([7, 8]))


def test_simulate_takes_the_router_and_its_weights(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--profile", "cpu-2core-smollm2", "--random-input-len", "64", "--random-output-len", "4",
            "--num-prompts", "12", "--request-rate", "1", "--max-slots", "2", "--replicas", "2"]
    assert main([*argv, "--router", "kv", "--router-weights", "3,1,2", "--routing-stats-period", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "2 replica(s), 2 slots each, router kv" in out and "requests            12 (0 failed)" in out
    assert "prompt tokens from the prefix cache" in out
    with pytest.raises(SystemExit):
        main([*argv, "--router", "nearest"])
    capsys.readouterr()
    for router in ("text", "least-busy"):
        assert main([*argv, "--router", router, "--route-imbalance", "4", "--route-max-chars", "1000"]) == 0
        assert f"router {router}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--router", "kv", "--router-balance", "64,0.5"])
    assert "a ratio >= 1" in capsys.readouterr().err
