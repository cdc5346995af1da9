"""The KV-aware router (frontend/prefix_routing.py) over simulated replicas, reports and all.

Each replica reports its digest and KV use every report_period_s of virtual time, its phase spread over the
period (replica i first at i / n of it), so that the router routes on what the replicas held up to a period ago,
as it would in a deployment. The loads are the router's own count, as the deployment's (cobali/ray/policy.py):
the requests sent and not finished, and the tokens each was expected to compute where it went (its prompt less
the leading blocks the router believed that replica held); the requests in flight, and when each finishes, as the
deployment's router is told. Routed on a report's second-old counts instead,
requests herded onto the replica that reported least.
"""

from __future__ import annotations

from collections.abc import Sequence

from cobali.engine.engine import Engine
from cobali.engine.prefix_digest import DigestBuilder, prompt_blocks
from cobali.frontend.prefix_routing import PrefixRouter, ReplicaLoad, RoutingConfig


class KvRouting:
    def __init__(self, config: RoutingConfig, n_replicas: int, seed: int = 0) -> None:
        self.config = config
        self.router: PrefixRouter[int] = PrefixRouter(config, seed)
        self.builders = [DigestBuilder(config.block_tokens, config.max_blocks) for _ in range(n_replicas)]
        self._kv_use = [0.0] * n_replicas
        self._next_report = [config.report_period_s * i / n_replicas for i in range(n_replicas)]
        self._in_flight: dict[int, tuple[int, list[int]]] = {}  # request index -> its replica and blocks
        self.reports = 0

    def pick(self, engines: Sequence[Engine], queues: Sequence[tuple[int, int]], tokens: Sequence[int],
             session: str | None, t: float, index: int) -> tuple[int, int]:
        """The replica for request `index`, its prompt arriving at t, each engine already run up to t, and the
        tokens it is expected to compute there; queues: each one's requests in flight and their tokens to
        compute. The request is in flight there until finished() names it."""
        assert len(engines) == len(queues) == len(self.builders)
        for i, engine in enumerate(engines):
            if t >= self._next_report[i]:
                self._report(i, engine)
                period = self.config.report_period_s
                self._next_report[i] += period * ((t - self._next_report[i]) // period + 1)
        loads = {i: ReplicaLoad(requests, work, self._kv_use[i]) for i, (requests, work) in enumerate(queues)}
        blocks = prompt_blocks(tokens, self.config.block_tokens)
        work = [self.router.uncached_tokens(i, blocks, len(tokens)) for i in range(len(engines))]  # before route()
        picked = self.router.route(blocks, len(tokens), loads, session)
        self.router.started(picked, blocks)
        self._in_flight[index] = (picked, blocks)
        return picked, work[picked]

    def finished(self, indices: Sequence[int]) -> None:
        """These requests ended (as the deployment's router hears it: the response is over)."""
        for index in indices:
            self.router.finished(*self._in_flight.pop(index))

    def _report(self, i: int, engine: Engine) -> None:
        self.router.report(i, frozenset(self.builders[i].digest(engine.held_prefixes())))
        self._kv_use[i] = engine.kv_use()
        self.reports += 1
