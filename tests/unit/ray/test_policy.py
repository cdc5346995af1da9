"""The router's policy (cobali.ray.policy), as cobali.ray.router drives it: a prompt goes back to the replica
holding its prefix (reported, or sent there since the last report), with no shared prefix the load stays
balanced, a hot prefix is spread once the queues are imbalanced, and pinned calls and refusals are honoured."""

from __future__ import annotations

import itertools
import random
from collections import Counter, deque

from cobali.frontend.prefix_routing import RoutingConfig
from cobali.ray.policy import Policy, PolicyConfig, RoutingHint

REPLICAS = ["a", "b", "c", "d"]
BLOCK = RoutingConfig().block_tokens


def prompt(n_blocks: int, start: int) -> RoutingHint:
    """A prompt of n_blocks whole blocks, its hashes start, start + 1, ... (a chain: distinct starts share none)."""
    return RoutingHint(tuple(range(start, start + n_blocks)), n_blocks * BLOCK + 7)


def report(policy: Policy, replica: str, seq: int, hashes: set[int] | frozenset[int] = frozenset(),
           kv_use: float = 0.0) -> None:
    policy.report(replica, {"seq": seq, "at": 0.0, "hashes": list(hashes), "kv_use": kv_use})


def route(policy: Policy, hint: RoutingHint, call: str, replicas: list[str] | None = None) -> str:
    ranks = policy.rank(hint, replicas or REPLICAS)
    policy.routed(call, ranks[0][0], hint)
    return ranks[0][0]


def test_a_prompt_goes_back_to_the_replica_that_reports_its_prefix() -> None:
    policy = Policy(PolicyConfig(), seed=1)
    policy.retain(REPLICAS)
    shared = prompt(20, 1000)
    report(policy, "c", 1, set(shared.blocks))
    for i in range(3):  # c busier than the rest, within the balance thresholds: the prefix outweighs it
        policy.routed(f"busy{i}", "c", prompt(1, 10 * i))
    assert [route(policy, shared, f"x{i}") for i in range(5)] == ["c"] * 5
    assert policy.counts["prefix"] == 5
    report(policy, "c", 2)  # c evicted it (and what was sent since the report before last is forgotten)
    report(policy, "c", 3)
    report(policy, "a", 1, set(shared.blocks))
    assert route(policy, shared, "y") == "a"


def test_a_conversation_s_turns_meet_their_prefix_before_any_report() -> None:
    policy = Policy(PolicyConfig(), seed=2)
    first = prompt(10, 500)
    replica = route(policy, first, "turn1")
    policy.completed("turn1")
    for other in REPLICAS:  # others finish work, so the load does not decide
        policy.routed(f"w-{other}", other, prompt(2, hash(other) % 100))
    longer = RoutingHint((*first.blocks, 900, 901), 12 * BLOCK)
    assert route(policy, longer, "turn2") == replica


def test_a_context_s_next_request_goes_where_it_is_being_computed() -> None:
    policy = Policy(PolicyConfig(), seed=3)
    policy.retain(REPLICAS[:2])
    context = prompt(24, 2000)
    cold = route(policy, context, "cold", REPLICAS[:2])
    for seq in (1, 2, 3):  # its prefill takes seconds: the replicas report before it computed any block
        for replica in REPLICAS[:2]:
            report(policy, replica, seq)
    assert route(policy, context, "warm", REPLICAS[:2]) == cold, "not computed a second time elsewhere"
    policy.completed("cold"), policy.completed("warm")
    report(policy, cold, 4), report(policy, cold, 5)
    assert policy._prefix is not None and policy._prefix.matched_blocks(cold, context.blocks) == 0


def test_with_no_shared_prefix_the_load_stays_balanced() -> None:
    policy = Policy(PolicyConfig(), seed=3)
    rng = random.Random(3)
    in_flight: deque[str] = deque()
    picks: Counter[str] = Counter()
    queues: Counter[str] = Counter()
    most_apart = 0
    where: dict[str, str] = {}
    for i in range(2000):
        hint = prompt(rng.randint(1, 30), 10_000 * (i + 1))  # each prompt its own
        call = str(i)
        where[call] = route(policy, hint, call)
        picks[where[call]] += 1
        queues[where[call]] += 1
        in_flight.append(call)
        while len(in_flight) > 12 or (in_flight and rng.random() < 0.4):
            done = in_flight.popleft() if rng.random() < 0.7 else in_flight.pop()
            policy.completed(done)
            queues[where[done]] -= 1
        most_apart = max(most_apart, max(queues[r] for r in REPLICAS) - min(queues[r] for r in REPLICAS))
    assert min(picks.values()) > 0.8 * max(picks.values()), picks
    assert most_apart <= 6, most_apart  # by work: never far apart, where 12 in flight could all sit on one
    assert policy.counts["prefix"] == 0 and policy.counts["load"] == 2000


def test_a_hot_prefix_is_spread_once_the_queues_are_imbalanced() -> None:
    config = PolicyConfig(routing=RoutingConfig(balance_abs=4, balance_rel=1.5))
    policy = Policy(config, seed=4)
    hot = prompt(20, 7)
    report(policy, "a", 1, set(hot.blocks))
    picks = Counter(route(policy, hot, str(i)) for i in range(40))  # none completes: the queues grow
    assert picks["a"] < 40 and len(picks) > 1, picks
    assert policy.counts["balance"] > 0
    assert max(picks.values()) - min(picks[r] for r in REPLICAS) <= 2 * 4 + 2, picks  # the thresholds hold it


def test_pinned_calls_and_refusals() -> None:
    policy = Policy(PolicyConfig(), seed=5)
    assert policy.rank(RoutingHint(replica="b"), REPLICAS) == [["b"]]
    assert policy.rank(RoutingHint(replica="gone"), REPLICAS) == []  # the router waits, the ingress times out
    ranks = policy.rank(RoutingHint(avoid=frozenset({"a", "b"})), REPLICAS)
    assert ranks[0][0] in ("c", "d") and sorted(ranks[-1]) == ["a", "b"]
    everyone = policy.rank(RoutingHint(avoid=frozenset(REPLICAS)), REPLICAS)
    assert everyone and everyone[0][0] in REPLICAS  # all refused: tried again rather than never
    policy.routed("p", "b", RoutingHint(replica="b"))
    assert policy.counts["pinned"] == 1


def test_a_report_is_taken_once_and_a_replica_gone_is_forgotten() -> None:
    policy = Policy(PolicyConfig(), seed=6)
    policy.retain(["a", "b"])
    shared = prompt(8, 50)
    report(policy, "b", 1, set(shared.blocks), kv_use=0.5)
    report(policy, "b", 1)  # the same report, collected again: nothing changes
    assert route(policy, shared, "1", ["a", "b"]) == "b"
    assert set(policy.report_ages(now=10.0)) == {"b"}
    policy.retain(["a"])
    assert policy.report_ages() == {}
    assert route(policy, shared, "2", ["a"]) == "a"
    policy.completed("1")  # the gone replica's last call completes: nothing of it is left
    assert "b" not in policy._queue


def test_least_busy_takes_the_less_busy_of_two() -> None:
    policy = Policy(PolicyConfig("least-busy"), seed=7)
    for i in range(5):
        policy.routed(f"a{i}", "a", None)
    policy.routed("b0", "b", None)
    assert {policy.rank(None, ["a", "b"])[0][0] for _ in range(20)} == {"b"}
    calls = itertools.count()
    picks = Counter(route(policy, RoutingHint(), str(next(calls))) for _ in range(400))
    assert min(picks.values()) > 80, picks


def test_the_text_policy_routes_by_the_prompt_s_text() -> None:
    policy = Policy(PolicyConfig("text"), seed=8)
    system = "You are a helpful assistant who answers in French. " * 10
    first = route(policy, RoutingHint(text=system + "Question one?"), "1")
    policy.completed("1")
    assert route(policy, RoutingHint(text=system + "Question two?"), "2") == first
    assert policy.counts["text"] == 2


def test_a_replica_busy_with_warm_turns_is_not_as_loaded_as_one_computing_a_cold_context() -> None:
    """A request's work is what it computes where it went: a warm turn's few tokens, not its whole prompt."""
    policy = Policy(PolicyConfig(), seed=3)
    policy.retain(["a", "b"])
    context = prompt(24, 100)
    report(policy, "a", 1, set(context.blocks))
    warm = [RoutingHint((*context.blocks, 200 + i), 25 * BLOCK) for i in range(2)]
    assert [route(policy, hint, f"warm{i}", ["a", "b"]) for i, hint in enumerate(warm)] == ["a", "a"]
    policy.routed("cold", "b", prompt(24, 300))  # b computes a whole context
    # a's two turns, a block each to compute, weigh less than b's 24 blocks: the next cold prompt goes to a.
    assert route(policy, prompt(24, 400), "next", ["a", "b"]) == "a"
    assert policy.counts["load"] == 1


def test_uncached_tokens_is_the_prompt_less_the_leading_blocks_held() -> None:
    policy = Policy(PolicyConfig(), seed=4)
    hint = prompt(10, 700)
    report(policy, "a", 1, set(hint.blocks[:4]))
    assert route(policy, hint, "one", ["a"]) == "a"
    assert policy._work["a"] == hint.n_tokens - 4 * BLOCK
    policy.completed("one")
    assert policy._work["a"] == 0


def test_a_burst_ranked_before_any_is_routed_is_spread() -> None:
    """Ray Serve says where a call went only once a replica took it: calls ranked meanwhile count where they were
    ranked, or a burst sees the same loads and herds onto one replica (here the one reporting less KV in use)."""
    policy = Policy(PolicyConfig(), seed=9)
    policy.retain(["a", "b"])
    report(policy, "a", 1, kv_use=0.1)
    burst = [RoutingHint((), 12) for _ in range(16)]  # prefix-less, and equal: told apart by identity
    chosen = [policy.rank(hint, ["a", "b"])[0][0] for hint in burst]
    assert min(Counter(chosen).values()) >= 6, Counter(chosen)
    for i, (hint, replica) in enumerate(zip(burst, chosen, strict=True)):
        policy.routed(f"c{i}", replica, hint)
    assert policy.in_flight() == dict(Counter(chosen)), "held counts became the calls' own, none twice"
    for i in range(16):
        policy.completed(f"c{i}")
    assert policy.in_flight() == {"a": 0, "b": 0} and policy._work["a"] == policy._work["b"] == 0
