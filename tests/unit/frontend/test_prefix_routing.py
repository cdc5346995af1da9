"""Routing by the KV: the digest a replica publishes (prefix_digest.py) and the router that reads it
(prefix_routing.py)."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.frontend.prefix_digest import DigestBuilder, block_hashes, prompt_blocks
from cobali.frontend.prefix_routing import PrefixRouter, ReplicaLoad, RoutingConfig

B = 4  # tokens per block in these tests


def tokens(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 90 for i in range(n)]


def idle(n: int) -> dict[int, ReplicaLoad]:
    return {i: ReplicaLoad(0, 0.0) for i in range(n)}


def test_block_hashes_chain_whole_blocks_and_are_stable() -> None:
    a, b = tokens(10, 1), tokens(10, 2)
    assert len(block_hashes(a, B)) == 2, "only whole blocks"
    assert block_hashes(a[:8] + b[8:], B) == block_hashes(a, B), "what follows the blocks changes nothing"
    changed = [a[0] + 1, *a[1:]]
    assert not set(block_hashes(changed, B)) & set(block_hashes(a, B)), "a block's hash stands for all before it"
    # Router and replicas are different processes: the hash may not be Python's salted hash().
    assert block_hashes(list(range(1, 5)), B) == [0x2BA42C3CDEEFADA8]


def test_a_prompt_is_hashed_without_its_last_token_and_under_its_salt() -> None:
    prompt = tokens(9, 3)
    assert prompt_blocks(prompt, B) == block_hashes(prompt, B), "9 tokens: 2 blocks either way"
    assert prompt_blocks(prompt[:8], B) == block_hashes(prompt, B)[:1], "the last token is always computed"
    salted = prompt_blocks(prompt, B, cache_salt="tenant")
    assert len(salted) == 2 and not set(salted) & set(prompt_blocks(prompt, B))


def make_engine(slots: int = 2, host_mib: int = 0) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_batch=64, kv_bytes_per_token=2**20 // 64)
    return Engine(backend, EngineConfig(max_slots=slots, n_batch=64, host_cache_mib=host_mib))


def run(engine: Engine, prompt: list[int], salt: str | None = None) -> None:
    LLM(engine).generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, cache_salt=salt))


def test_an_engines_digest_holds_what_its_next_turn_reuses() -> None:
    engine = make_engine(host_mib=8)  # 512 tokens
    context = tokens(40, 5)
    run(engine, context)
    run(engine, tokens(40, 6), salt="other")
    digest = DigestBuilder(B, 1000).digest(engine.held_prefixes())
    follow_up = context + tokens(12, 7)
    assert all(h in digest for h in prompt_blocks(follow_up, B)[:10]), "the context's 10 blocks"
    assert prompt_blocks(follow_up, B)[10] not in digest
    assert not set(prompt_blocks(tokens(40, 6), B)) & digest, "another salt's KV matches no unsalted prompt"
    assert set(prompt_blocks(tokens(40, 6), B, cache_salt="other")) <= digest
    for n in range(3, 6):  # more prompts than slots: the older ones live on in host memory
        run(engine, tokens(40, n * 10))
    assert len(engine.held_prefixes()) > 2
    assert set(prompt_blocks(context, B)) <= DigestBuilder(B, 1000).digest(engine.held_prefixes())


def test_a_digest_is_capped_most_recent_first_and_never_holds_a_block_without_its_predecessors() -> None:
    recent, shared, old = (np.asarray(tokens(40, s), dtype=np.int64) for s in (1, 2, 3))
    extended = np.concatenate([shared, tokens(8, 4)])
    digest = DigestBuilder(B, max_blocks=21).digest([recent, shared, extended, old])
    chain = block_hashes(extended, B)  # 12 blocks, the first 10 shared's
    assert digest == set(block_hashes(recent, B)) | set(chain[:11]), "blocks held twice count once"
    assert [h in digest for h in chain] == [True] * 11 + [False], "what is held of a prefix is its start"


def test_a_digest_rehashes_only_arrays_it_has_not_seen() -> None:
    cached = [np.asarray(tokens(400, s), dtype=np.int64) for s in range(8)]
    builder = DigestBuilder(B, 10_000)
    first = builder.digest(cached)
    assert builder.hashed_blocks == 800
    running = np.asarray(tokens(40, 99), dtype=np.int64)
    assert builder.digest([running, *cached]) == first | set(block_hashes(running, B))
    assert builder.hashed_blocks == 810, "the cached prefixes' hashes came from the last digest"
    assert builder.digest([np.array(a) for a in cached]) == first and builder.hashed_blocks == 1610, "copies"


def router(**config: float) -> PrefixRouter[int]:
    return PrefixRouter(RoutingConfig(block_tokens=B, **config), seed=1)  # type: ignore[arg-type]


def test_the_replica_holding_the_prefix_wins_unless_its_load_outweighs_it() -> None:
    prompt = tokens(41, 1)
    blocks = prompt_blocks(prompt, B)
    r = router()
    r.report(2, frozenset(blocks[:8]))  # 32 of 41 tokens: 3 * 0.78 = 2.3 of score
    assert r.matched_blocks(2, blocks) == 8 and r.matched_blocks(0, blocks) == 0
    assert {r.route(blocks, len(prompt), idle(4)) for _ in range(20)} == {2}
    busy = idle(4) | {2: ReplicaLoad(8, 4000.0, 0.5)}  # most work (-2) and half its KV in use (-1)
    elsewhere = r.route(blocks, len(prompt), busy)
    assert elsewhere != 2
    assert r.route(blocks, len(prompt), idle(4)) == elsewhere, "it holds all the prompt now: it was sent there"
    assert r.balanced == 0


def test_imbalanced_queues_route_by_load_alone_so_no_prompt_pins_a_replica() -> None:
    prompt = tokens(41, 1)
    blocks = prompt_blocks(prompt, B)
    r = router(w_queue=0.0, w_kv=0.0)  # nothing but the balance thresholds stands against the prefix
    r.report(0, frozenset(blocks))
    hot = idle(4) | {0: ReplicaLoad(65, 65.0)}
    assert {r.route(blocks, len(prompt), hot) for _ in range(40)} == {1, 2, 3}
    assert r.balanced == 40
    r = router(w_queue=0.0, w_kv=0.0)
    r.report(0, frozenset(blocks))
    relative = {0: ReplicaLoad(130, 130.0), 1: ReplicaLoad(100, 100.0)}  # 30 apart, but under 1.5 times
    assert r.route(blocks, len(prompt), relative) == 0 and r.balanced == 0


def test_a_session_breaks_ties_and_routing_is_deterministic_by_seed() -> None:
    prompt = tokens(4, 1)
    blocks = prompt_blocks(prompt, B)
    assert blocks == [], "shorter than a block (but its last token): no replica holds any of it"
    r = router()
    first = r.route(blocks, len(prompt), idle(8), session="alice")
    assert {r.route(blocks, len(prompt), idle(8), session="alice") for _ in range(30)} == {first}
    one, two = router(), router()
    picks = [one.route(prompt_blocks(tokens(6, s), B), 6, idle(8)) for s in range(40)]
    assert len(set(picks)) > 1, "ties without a session: drawn"
    assert picks == [two.route(prompt_blocks(tokens(6, s), B), 6, idle(8)) for s in range(40)]


def test_blocks_sent_count_until_two_reports_have_passed() -> None:
    prompt = tokens(41, 1)
    blocks = prompt_blocks(prompt, B)
    r = router()
    sent = r.route(blocks, len(prompt), idle(4))
    assert r.matched_blocks(sent, blocks) == 10, "before any report: what was sent there"
    r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 10, "a report may predate the request's prefill"
    r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 0, "two reports without it: evicted"


def test_the_routers_memory_is_bounded() -> None:
    r = router(max_blocks=15, max_sessions=3)
    for s in range(10):
        prompt = tokens(41, s)
        r.route(prompt_blocks(prompt, B), len(prompt), {0: ReplicaLoad(0, 0.0)}, session=f"user {s}")
    assert len(r._sessions) == 3 and list(r._sessions) == ["user 7", "user 8", "user 9"]
    assert len(r._held[0].sent) <= 15


@pytest.mark.parametrize("config", [dict(w_queue=-1.0), dict(balance_rel=0.5), dict(block_tokens=0),
                                    dict(report_period_s=0.0)])
def test_bad_settings_are_refused(config: dict) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**config)
    with pytest.raises(ValueError, match="no replica"):
        router().route([], 1, {})
