"""Replicas that share one host's CPUs.

A cost profile is calibrated with one engine on a machine of its own. Replicas deployed side by side on one host
(two one-thread engines on a 2-core VM, under Ray) are not: while both compute, whatever else runs there (Ray's
controller, proxy and GCS, the ingress, the clients) takes its share of the same cores, and the engines' ticks
run slower than the profile. A replica is idle far more often under a router that keeps each context in one place,
so how much slower depends on the router: the simulator has to model it rather than fold it into the profile.

SharedHost: `cores` CPUs, of which `background` are taken by everything that is not an engine. While k engines of
`threads` threads each compute at once, a tick takes pace x max(1, k x threads / (cores - background)) times the
profile's time. `pace` is what no share of CPUs explains: how much slower the host's engines tick than the
profile's calibration even with a core to spare (measured: a deployment's tick seconds against the simulator's
for the same tokens, bench/serving/prefix_routing.py --compare). The replicas are stepped in time order, so that
each tick sees the others as they are at its start: the one whose clock is earliest goes next.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SharedHost:
    cores: float
    background: float = 0.0  # CPUs that something other than the engines keeps busy, on average
    threads: int = 1  # per engine
    pace: float = 1.0

    def __post_init__(self) -> None:
        if not self.cores > self.background >= 0:
            raise ValueError(f"--host-background {self.background:g} must be at least 0 and below --host-cores "
                             f"{self.cores:g}")
        if self.threads < 1:
            raise ValueError(f"an engine needs at least one thread, got {self.threads}")
        if not self.pace > 0:
            raise ValueError(f"--host-pace must be above 0, got {self.pace:g}")

    def slowdown(self, computing: int) -> float:
        """How much longer than the profile's a tick takes while `computing` engines (this one included) run."""
        return self.pace * max(1.0, computing * self.threads / (self.cores - self.background))


class Stepped(Protocol):
    """A replica as the host steps it (cobali.sim.cluster.Replica)."""

    @property
    def now(self) -> float: ...

    @property
    def has_work(self) -> bool: ...

    def step(self, slowdown: float) -> list[int]: ...


def run_together(replicas: Sequence[Stepped], t: float, host: SharedHost) -> list[int]:
    """Step every replica with work until its clock reaches t, the earliest first; the requests that ended.

    A replica computes at time `now` if it has work, or if its clock is past `now` (a tick that began earlier has
    not ended yet): with the earliest stepped first, every other clock is at or past `now`."""
    ended: list[int] = []
    heap = [(r.now, i) for i, r in enumerate(replicas) if r.has_work and r.now < t]
    heapq.heapify(heap)
    while heap:
        now, i = heapq.heappop(heap)
        computing = sum(1 for r in replicas if r.has_work or r.now > now)
        replica = replicas[i]
        ended += replica.step(host.slowdown(computing))
        if replica.has_work and replica.now < t:
            heapq.heappush(heap, (replica.now, i))
    return ended
