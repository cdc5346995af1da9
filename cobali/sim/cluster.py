"""Simulated serving: open-loop arrivals on a virtual clock, routed over K independent engines.

Each replica is the real Engine on a SimBackend with its own virtual clock. Replicas never interact
except through the router, which needs every replica's state at an arrival's time, so before each
arrival every busy replica is stepped until its clock reaches it; the order in which replicas are
advanced does not matter. The router picks the replica with the fewest queued tokens (prompt and
output tokens of its unfinished requests not yet computed), or, given a RoutingConfig, the one the KV-aware
router scores best (sim/routing.py: by the prefix each replica last reported, its queue and KV use); given a
TextRoutingConfig, the approximate prefix tree's pick; given PowerOfTwo, Ray Serve's default's (sim/routers.py). Each
engine is fed from a backlog through a bounded window (cobali.frontend.offline.LLM), so an overloaded replica does
not slow the simulation down with a long wait queue.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from cobali.backends.llama_cpp.config import PREFILL_TILE
from cobali.engine.costs import DEFAULT_CHARS_PER_TOKEN, CostProfile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM, Pending
from cobali.frontend.prefix_routing import RoutingConfig
from cobali.frontend.text_prefix_routing import TextRoutingConfig
from cobali.harness.driver import user_cpu_seconds
from cobali.harness.latency import RequestTiming, request_timing, summarize_timings
from cobali.sim.backend import SimBackend
from cobali.sim.host import SharedHost, run_together
from cobali.sim.routers import PowerOfTwo, TextRouting, TwoChoices
from cobali.sim.routing import KvRouting

Routing = KvRouting | TextRouting | TwoChoices


@dataclass(frozen=True)
class SimSpec:
    costs: CostProfile
    config: EngineConfig
    n_ctx_seq: int = 2048
    kv_unified: bool = False
    replicas: int = 1
    prefill_tile: int = PREFILL_TILE  # the simulated scheduler decides as it would on llama.cpp
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN  # how text prompts become simulated tokens
    routing: RoutingConfig | TextRoutingConfig | PowerOfTwo | None = None  # None: to the fewest queued tokens
    seed: int = 0  # the routers' draws
    host: SharedHost | None = None  # None: each replica on CPUs of its own


@dataclass(frozen=True)
class SimItem:
    tokens: list[int]
    max_tokens: int
    session: str | None = None  # a conversation's turns share one: the prefix routers' ties go to its last replica
    text: str | None = None  # the prompt as text, for the text router (None: a stand-in written from the tokens)


@dataclass(frozen=True)
class Finished:
    """What is kept of a request once it ends (not the request: 10^5 of them hold too many lists)."""

    timing: RequestTiming
    prompt_tokens: int
    output_tokens: int
    failed: bool


class Replica:
    def __init__(self, spec: SimSpec, finished: list[Finished | None]) -> None:
        config = spec.config
        self.backend = SimBackend(spec.costs, n_seq_max=config.max_slots, n_ctx_seq=spec.n_ctx_seq,
                                  n_batch=config.n_batch, kv_unified=spec.kv_unified, prefill_tile=spec.prefill_tile)
        self.clock = self.backend.clock
        self.engine = Engine(self.backend, config, clock=self.clock, costs=spec.costs)
        self.engine.on_tick = self._on_tick
        self.llm = LLM(self.engine, LLM.feed_window(self.engine))
        self.finished = finished
        self.outstanding = 0  # prompt + max output tokens of everything routed here and not finished
        self._cost: dict[int, int] = {}  # each of those's, by its index
        self._work: dict[int, int] = {}  # and the tokens the router expected each to compute here
        self.routed_work = 0  # their sum: a router's count of its work (cobali/ray/policy.py)
        self.ticks = self.batch_tokens = self.wasted = self.routed = 0

    def queued_tokens(self) -> int:
        return self.outstanding - self.engine.stats().kv_used_tokens

    @property
    def queue(self) -> int:
        """Requests routed here and not finished: in the backlog, waiting or running."""
        return len(self._cost)

    def arrive(self, index: int, item: SimItem, t: float, work: int) -> None:
        self.clock.advance_to(t)  # an idle replica's clock waits here; a busy one is already past t
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        self.llm.push(Pending(index, item.tokens, params, arrival_time=t))
        self._cost[index] = len(item.tokens) + item.max_tokens
        self.outstanding += self._cost[index]
        self._work[index] = work
        self.routed_work += work
        self.routed += 1

    @property
    def now(self) -> float:
        return self.clock.now

    @property
    def has_work(self) -> bool:
        return self.llm.has_work

    def run_until(self, t: float) -> list[int]:
        """Step until the clock reaches t (or the work ends); the requests that finished meanwhile."""
        ended = []
        while self.llm.has_work and self.clock.now < t:
            ended += self.step()
        return ended

    def step(self, slowdown: float = 1.0) -> list[int]:
        """One tick, `slowdown` times as long as the profile's; the requests that finished in it."""
        self.backend.slowdown = slowdown
        ended = []
        for index, output in self.llm.step():
            assert isinstance(index, int)
            ended.append(index)
            self.outstanding -= self._cost.pop(index)
            self.routed_work -= self._work.pop(index)
            stats = output.stats
            assert stats is not None
            self.finished[index] = Finished(request_timing(stats), stats.n_prompt_tokens, stats.n_output_tokens,
                                            output.error is not None)
        return ended

    def _on_tick(self, record: TickRecord) -> None:
        self.ticks += 1
        self.batch_tokens += record.plan.n_tokens
        self.wasted += record.plan.wasted_slots


@dataclass
class SimResult:
    finished: list[Finished | None]
    replicas: list[Replica] = field(repr=False)
    makespan_s: float
    real_s: float
    cpu_s: float
    routing: Routing | None = field(default=None, repr=False)
    placements: list[int | None] = field(default_factory=list, repr=False)  # each request's replica (None: not routed)

    def summary(self) -> dict:
        """runner's summary keys; wall_s is virtual time and user_cpu_s the simulator's own CPU time."""
        done = [f for f in self.finished if f is not None]
        summary = summarize_timings([f.timing for f in done], prompt_tokens=sum(f.prompt_tokens for f in done),
                                    generated_tokens=sum(f.output_tokens for f in done),
                                    failed=sum(f.failed for f in done), wall_s=self.makespan_s, user_cpu_s=self.cpu_s)
        ticks = sum(r.ticks for r in self.replicas)
        busy = sum(r.backend.busy_s for r in self.replicas)
        summary.update({
            "ticks": ticks,
            "mean_batch_tokens": sum(r.batch_tokens for r in self.replicas) / ticks if ticks else 0.0,
            "wasted_decode_slots": sum(r.wasted for r in self.replicas),
            "host_ms_per_tick": 0.0,  # the profile's t0 holds host time; the clock never moves outside decode
            "host_share": 0.0,
            "replicas": len(self.replicas),
            "unfinished": len(self.finished) - len(done),
            "busy_share": busy / (self.makespan_s * len(self.replicas)) if self.makespan_s > 0 else 0.0,
            "sim_real_s": self.real_s,
        })
        summary.update(self._prefix_summary())
        return summary

    def _prefix_summary(self) -> dict:
        stats = [r.engine.stats() for r in self.replicas]
        queried = sum(s.prefix_queried_tokens for s in stats)
        routing = self.routing
        return {
            "preemptions": sum(s.preemptions for s in stats),
            "cached_tokens": sum(s.prefix_hit_tokens for s in stats),
            "prefix_hit_rate": sum(s.prefix_hit_tokens for s in stats) / queried if queried else 0.0,
            "router": "least-tokens" if routing is None else "kv" if isinstance(routing, KvRouting) else routing.name,
            "routed_by_load": 0 if routing is None else (routing.router if isinstance(routing, KvRouting)
                                                         else routing).balanced,
            "digest_reports": routing.reports if isinstance(routing, KvRouting) else 0,
        }


def simulate(items: Sequence[SimItem], arrivals: Sequence[float], spec: SimSpec,
             stop: StopRule | None = None) -> SimResult:
    """Run the workload; `stop` may end it early once its outcome is known (the rest stay unfinished)."""
    if len(arrivals) != len(items):
        raise ValueError(f"{len(items)} items but {len(arrivals)} arrival times")
    if spec.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {spec.replicas}")
    wall0, cpu0 = time.perf_counter(), user_cpu_seconds()
    finished: list[Finished | None] = [None] * len(items)
    placements: list[int | None] = [None] * len(items)
    replicas = [Replica(spec, finished) for _ in range(spec.replicas)]
    routing = make_routing(spec)
    engines = [r.engine for r in replicas]
    for index, (item, t) in enumerate(zip(items, arrivals, strict=True)):
        ended = run_all_until(replicas, t, spec.host)
        if isinstance(routing, KvRouting):
            routing.finished(ended)
        if stop is not None and stop.reached(finished):
            break
        if routing is None:
            picked = min(range(len(replicas)), key=lambda i: replicas[i].queued_tokens())
            work = len(item.tokens)
        else:
            # The loads a deployment's router knows: its own count of what it sent (cobali/ray/policy.py).
            queues = [(r.queue, r.routed_work) for r in replicas]
            if isinstance(routing, KvRouting):
                picked, work = routing.pick(engines, queues, item.tokens, item.session, t, index)
            else:
                picked, work = routing.pick(queues, item.text, item.tokens, item.session), len(item.tokens)
        replicas[picked].arrive(index, item, t, work)
        placements[index] = picked
    else:
        run_all_until(replicas, float("inf"), spec.host)
    end = max(r.clock.now for r in replicas)
    start = arrivals[0] if len(arrivals) else 0.0
    return SimResult(finished, replicas, end - start, time.perf_counter() - wall0, user_cpu_seconds() - cpu0, routing,
                     placements)


def run_all_until(replicas: list[Replica], t: float, host: SharedHost | None) -> list[int]:
    """Every replica stepped until its clock reaches t; the requests that ended. On a shared host in time order,
    each tick slowed by the others computing beside it; else one replica after another (none affects another)."""
    if host is not None:
        return run_together(replicas, t, host)
    return [i for replica in replicas for i in replica.run_until(t)]


def make_routing(spec: SimSpec) -> Routing | None:
    config = spec.routing
    if isinstance(config, RoutingConfig):
        return KvRouting(config, spec.replicas, spec.seed)
    if isinstance(config, TextRoutingConfig):
        return TextRouting(config, spec.chars_per_token, spec.seed)
    return TwoChoices(spec.replicas, spec.seed) if isinstance(config, PowerOfTwo) else None


@dataclass
class StopRule:
    """Stop once more than `fraction` of `total` requests (plus a margin) had a TTFT over `ttft_s`: the
    percentile is then over target whatever the rest do. Checks only newly finished requests."""

    ttft_s: float
    total: int
    fraction: float = 0.01
    late: int = 0
    _seen: int = 0

    def reached(self, finished: list[Finished | None]) -> bool:
        return False if self.ttft_s <= 0 else self._count(finished) >= self.fraction * self.total + 2

    def _count(self, finished: list[Finished | None]) -> int:
        # Requests finish roughly in arrival order; rescanning from the first unseen index keeps this cheap.
        while self._seen < len(finished) and (request := finished[self._seen]) is not None:
            ttft = request.timing.ttft_ms
            self.late += ttft is None or ttft > self.ttft_s * 1e3
            self._seen += 1
        return self.late
