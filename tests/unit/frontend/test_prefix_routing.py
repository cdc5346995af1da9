"""Routing by the KV: the router (prefix_routing.py) that reads what replicas report (engine/prefix_digest.py,
whose tests are tests/unit/engine/test_prefix_digest.py)."""

from __future__ import annotations

import pytest

from cobali.engine.prefix_digest import prompt_blocks
from cobali.frontend.prefix_routing import PrefixRouter, ReplicaLoad, RoutingConfig

B = 4  # tokens per block in these tests


def tokens(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 90 for i in range(n)]


def idle(n: int) -> dict[int, ReplicaLoad]:
    return {i: ReplicaLoad(0, 0.0) for i in range(n)}


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


def test_blocks_in_flight_count_until_finished_and_then_two_reports() -> None:
    prompt = tokens(41, 1)
    blocks = prompt_blocks(prompt, B)
    r = router()
    sent = r.route(blocks, len(prompt), idle(4))
    r.started(sent, blocks)
    r.started(sent, blocks[:4])  # a second request, sharing its first blocks
    for _ in range(5):  # queued, then seconds of prefill: reports made before its blocks were computed
        r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 10, "in flight there: it will hold them"
    r.finished(sent, blocks)
    r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 10, "finished since the last report: a report may predate it"
    r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 4, "two reports without it: evicted; the other request runs on"
    r.finished(sent, blocks[:4])
    r.report(sent, frozenset()), r.report(sent, frozenset())
    assert r.matched_blocks(sent, blocks) == 0 and not r._held[sent].in_flight
    r.forget(sent)
    r.finished(sent, blocks)  # a replica gone while its requests ran: nothing to count


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
