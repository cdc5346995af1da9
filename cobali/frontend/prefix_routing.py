"""A router that sends a request where its prompt's KV already is, unless the load says otherwise.

llm-d's scorer, on what each replica reports (engine/prefix_digest.py) and its load:

    score = w_prefix * matched_fraction - w_queue * work / most_work - w_kv * kv_use

matched_fraction: of the prompt's tokens, those in the leading blocks a replica holds. `work` is its queue, best in
tokens to compute, known fresh (a second-old figure herds requests onto whichever replica reported least): the
router's callers count, for each request routed and not finished, what it was expected to compute where it went
(uncached_tokens: its prompt less the leading blocks that replica held). Counting whole prompts instead makes a
replica busy with warm turns, a few tokens each, look as loaded as one computing a cold context. Normalised by the
most, so that a little more among light loads weighs little against a prefix. When the queues of requests are
imbalanced as SGLang's router judges it (the longest exceeds the shortest by more than balance_abs and is more than
balance_rel times it) the prefix is ignored and two replicas drawn at random, the less loaded taking the request: no
prompt can pin all traffic to one replica. A session's last replica wins a tie. With w_prefix above w_queue, a
replica holding all of a prompt outscores the others however much work it has, until its KV fills: for one hot
context, the balance thresholds are what spread it. SGLang's 64 suits batches of hundreds; for replicas of 32 slots,
16 (bench/sim/routing.py: one customer, 128 users, 8 replicas: TTFT p50 369 ms at 64, 24 ms at 16, 31 ms routed by
load alone).

A report is a period old at worst, and a prompt's blocks appear in one only once computed: a cold context waits
in the queue and then takes seconds of chunks. So the router believes a replica holds what it sent there: the
blocks of the requests its caller says are in flight there (started(), finished()), and those it sent since its
report before the last, the requests finished meanwhile among them. Remembering sends for two reports alone, a
context's next request arriving before the report that shows it computed went by load, and the context was
computed twice (bench/serving/prefix_routing.py --sim, --routing-stats-period 0.5).
Memory is bounded: a report's hashes are capped by the replica, the blocks remembered sent per replica by
max_blocks, those in flight by the requests in flight (each a prompt's blocks at most), and the sessions (least
recently used forgotten) by max_sessions.
"""

from __future__ import annotations

import bisect
import random
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)  # how the caller names a replica: an index in the simulator, a replica id in Ray


@dataclass(frozen=True)
class RoutingConfig:
    w_prefix: float = 3.0  # llm-d's weights
    w_queue: float = 2.0
    w_kv: float = 2.0
    balance_abs: int = 64  # SGLang's load-balance thresholds, on requests in each replica's queue
    balance_rel: float = 1.5
    block_tokens: int = 64  # tokens per hashed block
    max_blocks: int = 16384  # hashes in one replica's report (and blocks the router remembers sending it)
    report_period_s: float = 1.0  # how often a replica reports its digest
    max_sessions: int = 65536

    def __post_init__(self) -> None:
        if min(self.w_prefix, self.w_queue, self.w_kv) < 0:
            raise ValueError(f"routing weights must be >= 0, got {self.w_prefix}, {self.w_queue}, {self.w_kv}")
        if self.balance_abs < 0 or self.balance_rel < 1:
            raise ValueError(f"balance thresholds: absolute >= 0 and relative >= 1, got {self.balance_abs} and "
                             f"{self.balance_rel}")
        if min(self.block_tokens, self.max_blocks, self.max_sessions) < 1 or self.report_period_s <= 0:
            raise ValueError("block_tokens, max_blocks and max_sessions must be >= 1, report_period_s > 0")

    def tuned(self, weights: tuple[float, float, float] | None, balance: tuple[int, float] | None,
              report_period_s: float | None) -> RoutingConfig:
        """These settings with the flags given (--router-weights, --router-balance, --routing-stats-period;
        None: unchanged)."""
        w_prefix, w_queue, w_kv = weights or (self.w_prefix, self.w_queue, self.w_kv)
        balance_abs, balance_rel = balance or (self.balance_abs, self.balance_rel)
        return replace(self, w_prefix=w_prefix, w_queue=w_queue, w_kv=w_kv, balance_abs=balance_abs,
                       balance_rel=balance_rel, report_period_s=report_period_s or self.report_period_s)


@dataclass(frozen=True)
class ReplicaLoad:
    queue: int  # requests sent to it and not finished, waiting or running: what the balance thresholds count
    work: float  # what the score's queue term weighs: its tokens not yet computed where known fresh, else `queue`
    kv_use: float = 0.0  # the share of its KV cells in use, as last reported


class Sessions(Generic[K]):
    """Each session's last replica, which wins a tie; the least recently used forgotten past max_sessions."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._last: OrderedDict[str, K] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def __iter__(self) -> Iterator[str]:
        """The sessions remembered, least recently used first."""
        return iter(self._last)

    def remember(self, session: str | None, replica: K) -> None:
        if session is not None:
            self._last[session] = replica
            self._last.move_to_end(session)
            if len(self._last) > self.max_sessions:
                self._last.popitem(last=False)

    def pick(self, best: list[K], session: str | None, rng: random.Random) -> K:
        """Of the replicas tied `best`: the session's last, else one at random."""
        last = self._last.get(session) if session is not None else None
        if last is not None and last in best:
            return last
        return best[0] if len(best) == 1 else rng.choice(best)


def two_choices(loads: Mapping[K, ReplicaLoad], rng: random.Random) -> K:
    """Power of two choices: of two replicas drawn at random, the one with the shorter queue."""
    drawn = rng.sample(list(loads), min(2, len(loads)))
    return min(drawn, key=lambda replica: loads[replica].queue)


@dataclass
class _Held:
    reported: frozenset[int] = frozenset()
    sent: set[int] = field(default_factory=set)  # blocks sent (or finished) since the last report
    sent_before: set[int] = field(default_factory=set)  # and between the last two reports
    in_flight: Counter[int] = field(default_factory=Counter)  # blocks of the requests in flight, by how many hold it

    def holds(self, block: int) -> bool:
        return block in self.reported or block in self.sent or block in self.sent_before or self.in_flight[block] > 0


class PrefixRouter(Generic[K]):
    """Picks a replica for each request; deterministic given its seed and the order of the loads it is handed."""

    def __init__(self, config: RoutingConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._held: dict[K, _Held] = {}
        self._sessions: Sessions[K] = Sessions(config.max_sessions)
        self.balanced = 0  # requests routed by load alone, the queues being imbalanced

    def report(self, replica: K, hashes: frozenset[int]) -> None:
        """What `replica` holds now (its DigestBuilder's digest, made with this config's block_tokens)."""
        held = self._held.setdefault(replica, _Held())
        held.reported, held.sent_before, held.sent = hashes, held.sent, set()

    def started(self, replica: K, blocks: Sequence[int]) -> None:
        """A request of these blocks is in flight at `replica`: they count as held there until it finishes."""
        self._held.setdefault(replica, _Held()).in_flight.update(blocks)

    def finished(self, replica: K, blocks: Sequence[int]) -> None:
        """That request finished (or failed): its blocks count as sent now, until the replica's reports show
        whether it keeps them."""
        held = self._held.get(replica)
        if held is None:  # forgotten meanwhile
            return
        held.in_flight.subtract(blocks)
        for block in blocks:
            if held.in_flight[block] <= 0:
                del held.in_flight[block]
        self._send(held, blocks)

    def forget(self, replica: K) -> None:
        """A replica gone: nothing is sent there again unless it comes back in the loads."""
        self._held.pop(replica, None)

    def matched_blocks(self, replica: K, blocks: Sequence[int]) -> int:
        """How many of `blocks`, from the first, `replica` holds (a digest holds a block's predecessors too)."""
        held = self._held.get(replica)
        if held is None or not blocks or not held.holds(blocks[0]):
            return 0  # most replicas hold none of a prompt: one look, not a search
        return bisect.bisect_left(range(len(blocks)), True, key=lambda i: not held.holds(blocks[i]))

    def uncached_tokens(self, replica: K, blocks: Sequence[int], n_tokens: int) -> int:
        """What `replica` would compute of a prompt of n_tokens: all but the leading blocks it holds, and at least
        the last token (it is computed for its logits). Ask before route(), which remembers the blocks sent."""
        return max(n_tokens - self.matched_blocks(replica, blocks) * self.config.block_tokens, 1)

    def route(self, blocks: Sequence[int], n_tokens: int, loads: Mapping[K, ReplicaLoad],
              session: str | None = None) -> K:
        """The replica for a prompt of n_tokens whose block hashes are `blocks` (prefix_digest.prompt_blocks)."""
        if not loads:
            raise ValueError("no replica to route to")
        queues = [load.queue for load in loads.values()]
        longest, shortest = max(queues), min(queues)
        if longest - shortest > self.config.balance_abs and longest > self.config.balance_rel * shortest:
            self.balanced += 1
            picked = two_choices(loads, self._rng)
        else:
            picked = self._best(blocks, n_tokens, loads, session)
        self._remember(picked, blocks, session)
        return picked

    def _best(self, blocks: Sequence[int], n_tokens: int, loads: Mapping[K, ReplicaLoad], session: str | None) -> K:
        c = self.config
        most = max(load.work for load in loads.values())
        scores: dict[K, float] = {}
        for replica, load in loads.items():
            matched = self.matched_blocks(replica, blocks) * c.block_tokens / n_tokens if n_tokens else 0.0
            work = load.work / most if most > 0 else 0.0
            scores[replica] = c.w_prefix * matched - c.w_queue * work - c.w_kv * load.kv_use
        top = max(scores.values())
        best = [replica for replica, score in scores.items() if score >= top - 1e-9]
        return self._sessions.pick(best, session, self._rng)

    def _remember(self, replica: K, blocks: Sequence[int], session: str | None) -> None:
        self._send(self._held.setdefault(replica, _Held()), blocks)
        self._sessions.remember(session, replica)

    def _send(self, held: _Held, blocks: Sequence[int]) -> None:
        if len(held.sent) + len(blocks) <= self.config.max_blocks:
            held.sent.update(blocks)
