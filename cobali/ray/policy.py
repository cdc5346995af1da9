"""Which engine replica a request goes to: the policy inside the ingress's Ray Serve request router.

cobali.ray.router hands this the replicas Ray Serve lists and the hint the ingress computed for the request
(cobali.ray.hints); this returns them ranked, the first rank preferred (Ray Serve takes the least loaded of a
rank whose queue has room, and goes down the ranks when none has). No Ray import here: the unit tests drive it.

Three policies (--router):
- kv: cobali.frontend.prefix_routing.PrefixRouter, llm-d's scorer on what each replica reports holding (its
  prefix blocks' hashes, its KV use: EngineReplica.record_routing_stats), the blocks of the calls in flight there
  (told it at routed() and completed()) and the work routed to it;
- text: cobali.frontend.text_prefix_routing.TextPrefixRouter, Ray Serve LLM's PrefixCacheAffinityRouter's shape,
  on the prompts' text as rendered;
- least-busy: the less busy of two replicas drawn at random.

The load is this router's own count, fresh at every request: requests routed to a replica and not completed
(its queue), and their tokens to compute (its work): under kv, each prompt less the leading blocks the router
believed that replica held when it was routed (PrefixRouter.uncached_tokens); otherwise the whole prompt; a
request without a hint counts as one token. A report's
token counts are a period old, and the simulator found that stale counts herd requests onto whichever
replica reported least (docs/results.md, issue 47). A hint may pin a call to one replica (the ingress asks
each for /metrics, /health, /slots) or ask that replicas which refused it be passed over.
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cobali.frontend.prefix_routing import PrefixRouter, ReplicaLoad, RoutingConfig
from cobali.frontend.text_prefix_routing import TextPrefixRouter, TextRoutingConfig
from cobali.http.config import ServerConfig

ReplicaId = str  # a replica as Ray Serve names it (ReplicaID.unique_id)
HOWS = ("prefix", "load", "balance", "text", "pinned")  # how requests were routed, for /metrics
MAX_PENDING = 4096  # calls ranked and not yet routed, held as counted (past it the oldest, cancelled, is dropped)


@dataclass(frozen=True)
class RoutingHint:
    """What the ingress tells the router about one call; it rides with the call as a keyword argument."""

    blocks: tuple[int, ...] = ()  # the prompt's block hashes (cobali.engine.prefix_digest.prompt_blocks)
    n_tokens: int = 0  # the prompt's tokens (0: unknown)
    text: str = ""  # the prompt as rendered, for the text policy
    session: str | None = None  # x-session-id, else the body's `user`: its last replica wins a tie
    replica: ReplicaId | None = None  # this replica only (a pinned call), or none
    avoid: frozenset[ReplicaId] = frozenset()  # replicas that refused this request (503): others first


@dataclass(frozen=True)
class PolicyConfig:
    """The router's settings, built from the flags; travels to the router as request_router_kwargs (JSON)."""

    policy: str = "kv"
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    def as_kwargs(self) -> dict[str, Any]:
        r = self.routing
        return {"policy": self.policy, "weights": [r.w_prefix, r.w_queue, r.w_kv],
                "balance": [r.balance_abs, r.balance_rel], "block_tokens": r.block_tokens,
                "max_blocks": r.max_blocks, "report_period_s": r.report_period_s}

    @classmethod
    def from_settings(cls, settings: ServerConfig) -> PolicyConfig:
        """From the flags: --router, --router-weights, --router-balance, --routing-stats-period."""
        routing = RoutingConfig().tuned(settings.router_weights, settings.router_balance,
                                        settings.routing_stats_period_s)
        return cls(settings.router or "kv", routing)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> PolicyConfig:
        if not kwargs:
            return cls()
        (w_prefix, w_queue, w_kv), (balance_abs, balance_rel) = kwargs["weights"], kwargs["balance"]
        return cls(kwargs["policy"], RoutingConfig(w_prefix, w_queue, w_kv, int(balance_abs), balance_rel,
                                                   kwargs["block_tokens"], kwargs["max_blocks"],
                                                   kwargs["report_period_s"]))


@dataclass(frozen=True)
class _Report:
    seq: int  # the replica's count of its reports: a new one is taken in once
    at: float  # its time.time() when made
    kv_use: float


class Policy:
    """Ranks replicas for each call; told when a call was routed and when it completed. Not thread-safe: one
    router's loop calls it; the ingress reads `counts` and report_ages() (plain reads) for /metrics."""

    def __init__(self, config: PolicyConfig, seed: int | None = None) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._prefix: PrefixRouter[ReplicaId] | None = None
        self._text: TextPrefixRouter[ReplicaId] | None = None
        if config.policy == "kv":
            self._prefix = PrefixRouter(config.routing, seed or 0)
        elif config.policy == "text":
            self._text = TextPrefixRouter(TextRoutingConfig(), seed or 0)
        self._in_flight: dict[str, tuple[ReplicaId, int, tuple[int, ...]]] = {}  # call id -> replica, tokens, blocks
        self._queue: Counter[ReplicaId] = Counter()
        self._work: Counter[ReplicaId] = Counter()
        self._reports: dict[ReplicaId, _Report] = {}
        # Calls ranked and not yet routed, by their hint's identity (two calls may carry equal hints): the hint,
        # the replica chosen, the tokens counted there meanwhile, and its tokens on each replica (kv) for routed().
        # Ray Serve tells where a call went only once a replica took it: a burst is ranked before any is routed,
        # and without this count every call of it would see the same loads and go to the same replica.
        self._pending: OrderedDict[int, tuple[RoutingHint, ReplicaId, int, dict[ReplicaId, int]]] = OrderedDict()
        self._known: set[ReplicaId] = set()  # the replicas Ray Serve listed last
        self.replicas: tuple[ReplicaId, ...] = ()  # the same, in its order, replaced whole: the ingress reads it
        self.counts: dict[str, int] = dict.fromkeys(HOWS, 0)

    def rank(self, hint: RoutingHint | None, replicas: Sequence[ReplicaId]) -> list[list[ReplicaId]]:
        """`replicas` ranked for this call: [[chosen], [the rest]]; [] if it is pinned to a replica not there. A call
        with a hint counts where it was ranked until routed() says where it went."""
        given, hint = hint, hint or RoutingHint()
        if hint.replica is not None:
            return [[hint.replica]] if hint.replica in replicas else []
        if not replicas:
            return []
        # Replicas that refused it go last; if all did, it tries them again rather than waiting for no one.
        fresh = [r for r in replicas if r not in hint.avoid] or list(replicas)
        work: dict[ReplicaId, int] = {}
        if self._prefix is not None:  # before route(), which remembers the blocks it sends
            work = {r: self._prefix.uncached_tokens(r, hint.blocks, hint.n_tokens) for r in fresh}
        self._release(hint)  # ranked again (Ray Serve backed off): its earlier choice no longer counts
        chosen = self._choose(hint, fresh)
        if given is not None:  # without a hint, routed() could not match it: nothing is held
            self._hold(hint, chosen, work)
        rest = [r for r in fresh if r != chosen]
        refused = [r for r in replicas if r in hint.avoid and r != chosen]
        return [rank for rank in ([chosen], rest, refused) if rank]

    def _choose(self, hint: RoutingHint, replicas: Sequence[ReplicaId]) -> ReplicaId:
        loads = {r: ReplicaLoad(self._queue[r], self._work[r] or self._queue[r], self._kv_use(r)) for r in replicas}
        if self._prefix is not None:
            holding = {r for r in replicas if self._prefix.matched_blocks(r, hint.blocks)}  # before route()
            balanced = self._prefix.balanced  # remembers what it sends
            chosen = self._prefix.route(hint.blocks, hint.n_tokens, loads, hint.session)
            self.counts["balance" if self._prefix.balanced > balanced else "prefix" if chosen in holding
                        else "load"] += 1
            return chosen
        if self._text is not None:
            self.counts["text"] += 1
            return self._text.route(hint.text, loads, hint.session)
        self.counts["load"] += 1
        drawn = self._rng.sample(list(replicas), min(2, len(replicas)))
        return min(drawn, key=lambda r: self._queue[r])

    def _hold(self, hint: RoutingHint, chosen: ReplicaId, work: dict[ReplicaId, int]) -> None:
        tokens = work.get(chosen, max(hint.n_tokens, 1))
        self._pending[id(hint)] = (hint, chosen, tokens, work)
        self._count(chosen, tokens)
        if len(self._pending) > MAX_PENDING:
            _, (_, oldest, old_tokens, _) = self._pending.popitem(last=False)
            self._uncount(oldest, old_tokens)

    def _release(self, hint: RoutingHint) -> dict[ReplicaId, int]:
        """Drop the count held for a ranked call; its tokens on each replica (empty if none was held)."""
        held = self._pending.get(id(hint))
        if held is None or held[0] is not hint:
            return {}
        del self._pending[id(hint)]
        self._uncount(held[1], held[2])
        return held[3]

    def _count(self, replica: ReplicaId, tokens: int) -> None:
        self._queue[replica] += 1
        self._work[replica] += tokens

    def _uncount(self, replica: ReplicaId, tokens: int) -> None:
        self._queue[replica] -= 1
        self._work[replica] -= tokens
        if not self._queue[replica] and replica not in self._known:  # the last call of a replica gone
            del self._queue[replica], self._work[replica]

    def _kv_use(self, replica: ReplicaId) -> float:
        report = self._reports.get(replica)
        return report.kv_use if report is not None else 0.0

    def routed(self, call: str, replica: ReplicaId, hint: RoutingHint | None) -> None:
        """The call went to `replica`: its load counts there until it completes."""
        if hint is not None and hint.replica is not None:
            self.counts["pinned"] += 1
        tokens = max(hint.n_tokens, 1) if hint is not None else 1
        if hint is not None:  # ranked by kv: what it computes where it went
            tokens = self._release(hint).get(replica, tokens)
        self.completed(call)  # a call routed again (its replica refused it) leaves the first one's count
        blocks = hint.blocks if hint is not None else ()
        self._in_flight[call] = (replica, tokens, blocks)
        self._count(replica, tokens)
        if self._prefix is not None:  # its blocks count as held there while it runs: a report shows them late
            self._prefix.started(replica, blocks)

    def completed(self, call: str) -> None:
        entry = self._in_flight.pop(call, None)
        if entry is not None:
            replica, tokens, blocks = entry
            self._uncount(replica, tokens)
            if self._prefix is not None:
                self._prefix.finished(replica, blocks)

    def report(self, replica: ReplicaId, stats: Mapping[str, Any]) -> None:
        """A replica's routing stats as Ray Serve last collected them (EngineReplica.record_routing_stats); taken
        in once per report."""
        seq = stats.get("seq")
        self._known.add(replica)
        last = self._reports.get(replica)
        if seq is None or (last is not None and last.seq == seq):
            return
        self._reports[replica] = _Report(seq, stats["at"], stats["kv_use"])
        if self._prefix is not None:
            self._prefix.report(replica, frozenset(stats["hashes"]))

    def retain(self, replicas: Collection[ReplicaId]) -> None:
        """Forget the replicas gone (scaled down, or dead): their reports and what was sent to them. Their calls
        in flight still complete (and leave their counts)."""
        for gone in self._known - set(replicas):
            self._reports.pop(gone, None)
            for router in (self._prefix, self._text):
                if router is not None:
                    router.forget(gone)
            if not self._queue[gone]:
                del self._queue[gone], self._work[gone]
        self._known = set(replicas)
        self.replicas = tuple(replicas)

    def in_flight(self) -> dict[ReplicaId, int]:
        """Calls routed to each listed replica and not completed."""
        return {replica: self._queue[replica] for replica in self.replicas}

    def report_ages(self, now: float | None = None) -> dict[ReplicaId, float]:
        """Seconds since each replica made the report the router holds."""
        now = time.time() if now is None else now
        return {replica: now - report.at for replica, report in dict(self._reports).items()}


# deployment name -> the policy of this process's router to it (cobali.ray.router), which the ingress reads. Here,
# not in the router's module: Ray Serve ships a router's module by value, and a dict there would be a copy.
_PUBLISHED: dict[str, Policy] = {}


def publish(deployment: str, policy: Policy) -> None:
    _PUBLISHED[deployment] = policy


def policy_of(deployment: str) -> Policy | None:
    """The policy of this process's router to `deployment`, once a handle to it has made one."""
    return _PUBLISHED.get(deployment)
