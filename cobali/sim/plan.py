"""Capacity planning: the fewest replicas whose simulated TTFT p99 meets a target at a request rate.

TTFT falls as replicas are added (each gets a smaller share of the same arrivals), so the search
doubles K from 1 until the target is met, then bisects between the last failing and the first passing
K. A trial that is already over target stops early (StopRule), which keeps overloaded trials cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cobali.sim.cluster import SimItem, SimResult, SimSpec, StopRule, simulate


@dataclass(frozen=True)
class Trial:
    replicas: int
    ttft_p99_ms: float | None  # None: stopped early, already over target
    real_s: float
    result: SimResult

    def meets(self, target_ms: float) -> bool:
        return self.ttft_p99_ms is not None and self.ttft_p99_ms <= target_ms


def run_trial(items: Sequence[SimItem], arrivals: Sequence[float], spec: SimSpec, replicas: int,
              target_ms: float) -> Trial:
    result = simulate(items, arrivals, replace(spec, replicas=replicas), StopRule(target_ms / 1e3, len(items)))
    summary = result.summary()
    p99 = None if summary["unfinished"] else summary["ttft_p99_ms"]
    return Trial(replicas, p99, result.real_s, result)


def plan_replicas(items: Sequence[SimItem], arrivals: Sequence[float], spec: SimSpec, target_ms: float,
                  max_replicas: int = 1024,
                  on_trial: Callable[[Trial], None] | None = None) -> tuple[Trial, list[Trial]]:
    """The passing trial with the fewest replicas, and every trial run (in order)."""
    if target_ms <= 0:
        raise ValueError(f"the TTFT target must be > 0 ms, got {target_ms}")
    trials: list[Trial] = []

    def trial(k: int) -> Trial:
        t = run_trial(items, arrivals, spec, k, target_ms)
        trials.append(t)
        if on_trial is not None:
            on_trial(t)
        return t

    low, high, best = 0, 1, trial(1)  # low: the most replicas known to fail
    while not best.meets(target_ms):
        if high >= max_replicas:
            raise ValueError(f"{max_replicas} replicas do not meet TTFT p99 <= {target_ms:g} ms")
        low, high = high, min(2 * high, max_replicas)
        best = trial(high)
    while high - low > 1:
        mid = (low + high) // 2
        t = trial(mid)
        if t.meets(target_ms):
            high, best = mid, t
        else:
            low = mid
    return best, trials
