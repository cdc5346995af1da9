"""The approximate policy (frontend/text_prefix_routing.py): a character-level prefix tree per replica."""

from __future__ import annotations

import random

import pytest

from cobali.frontend.prefix_routing import ReplicaLoad
from cobali.frontend.text_prefix_routing import TextPrefixRouter, TextRoutingConfig


def idle(n: int) -> dict[int, ReplicaLoad]:
    return {i: ReplicaLoad(0, 0.0) for i in range(n)}


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghij ") for _ in range(n))


def test_a_context_goes_back_to_the_replica_it_was_sent_to() -> None:
    rng = random.Random(0)
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig())
    contexts = [words(rng, 2000) for _ in range(4)]
    first = [router.route(c + words(rng, 50), idle(4)) for c in contexts]
    assert sorted(first) == [0, 1, 2, 3], "no match: the smallest tree, so each context to an empty replica"
    for _ in range(3):
        for context, replica in zip(contexts, first, strict=True):
            assert router.route(context + words(rng, 50), idle(4)) == replica
    assert router.balanced == 0


def test_below_the_match_rate_the_smallest_tree_wins() -> None:
    rng = random.Random(1)
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig(match_rate=0.1))
    shared = words(rng, 100)
    held = router.route(shared + words(rng, 200), idle(2))
    router.route(words(rng, 50), idle(2))  # the other replica, smaller
    assert router.held_chars(held) > router.held_chars(1 - held) > 0
    assert router.route(shared + words(rng, 800), idle(2)) == held, "100 of 900: over 10 %"
    assert router.route(shared + words(rng, 1100), idle(2)) == 1 - held, "100 of 1200: under 10 %"


def test_a_session_breaks_a_tie_and_only_a_tie() -> None:
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig(), seed=3)
    picks = {router.route("same text", idle(4), session="s") for _ in range(8)}
    assert len(picks) == 1, "all four empty at first, then one holds it"
    other = (picks.pop() + 1) % 4
    router.route("another text entirely", {other: ReplicaLoad(0, 0.0)})
    assert router.route("another text entirely", idle(4), session="s") == other, "the match beats the session"


def test_imbalanced_queues_route_by_power_of_two() -> None:
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig(imbalance=10))
    text = "a long shared system prompt " * 20
    holder = router.route(text, idle(2))
    at_threshold = {holder: ReplicaLoad(15, 15.0), 1 - holder: ReplicaLoad(5, 5.0)}
    assert router.route(text, at_threshold) == holder and router.balanced == 0, "10 apart: still by the prefix"
    over = {holder: ReplicaLoad(16, 16.0), 1 - holder: ReplicaLoad(5, 5.0)}
    assert all(router.route(text, over) == 1 - holder for _ in range(20)), "two drawn of two: the shorter queue"
    assert router.balanced == 20
    # Of many replicas, two drawn: the one holding the prefix under a long queue still gets none.
    loads = {i: ReplicaLoad(0 if i else 40, 0.0) for i in range(8)}
    assert 0 not in {router.route(text, loads) for _ in range(50)}


def test_memory_stays_capped_under_a_stream_of_long_distinct_texts() -> None:
    rng = random.Random(2)
    config = TextRoutingConfig(max_chars=20_000, max_sessions=16)
    router: TextPrefixRouter[int] = TextPrefixRouter(config)
    for i in range(120):
        # Longer than the cap, some; others sharing a head with an earlier one, so trees branch and get evicted.
        text = words(rng, rng.randrange(100, 30_000)) if i % 3 else f"head {i % 7} " * 50 + words(rng, 3000)
        router.route(text, idle(3), session=f"user {i}")
        for replica in range(3):
            tree = router._trees.get(replica)
            if tree is not None:
                assert tree.chars <= config.max_chars and tree.nodes <= tree.chars
                assert len(tree._leaves) <= 2 * tree.nodes + 66
    assert len(router._sessions) == 16
    assert sum(router.held_chars(r) for r in range(3)) > 2 * 15_000, "eviction keeps most of the cap, not little"
    router.forget(0)
    assert router.held_chars(0) == 0


def test_a_nodes_own_memory_counts_against_the_cap() -> None:
    """Texts nested a character apart cut the tree into one-character nodes, each some hundred bytes."""
    rng = random.Random(2)
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig(max_chars=20_000))
    nested = "".join(rng.choice("ab") for _ in range(3000))
    for _ in range(300):
        router.route(nested[: rng.randrange(1, 3000)] + "c", idle(1))
        assert router._trees[0].nodes <= 20_000 // 200  # 574 when nodes cost nothing


def test_routes_cost_steps_linear_in_their_texts() -> None:
    """Steps per character routed stay bounded on hostile texts: a single long edge split near its head over and
    over (a split copies at most one edge's bounded length), prefixes nested a character apart, eviction (its
    steps amortised over the characters inserted)."""
    rng = random.Random(4)
    router: TextPrefixRouter[int] = TextPrefixRouter(TextRoutingConfig(max_chars=200_000))
    long = "x" * 150_000
    texts = [long] + [long[:k] + "y" for k in range(1, 400)] + ["x" * k for k in range(1, 400, 7)]
    texts += [words(rng, 20_000) for _ in range(30)]
    for text in texts:
        router.route(text, {0: ReplicaLoad(0, 0.0)})
    # About 0.6 steps per character; 400 splits of the 150k edge, each copying its tail, would cost 70.
    total = sum(len(t) for t in texts)
    assert router.ops < 4 * total, (router.ops, total)


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="match_rate"):
        TextRoutingConfig(match_rate=1.5)
    with pytest.raises(ValueError, match="max_chars"):
        TextRoutingConfig(max_chars=0)
    with pytest.raises(ValueError, match="no replica"):
        TextPrefixRouter[int](TextRoutingConfig()).route("text", {})
