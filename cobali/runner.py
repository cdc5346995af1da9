"""One workload through one engine, offline: every item submitted at once, run to completion, with metrics.
`cobali run`, `cobali bench` and the benchmark scripts measure through it."""

from __future__ import annotations

import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from cobali.backends.base import SamplingParams
from cobali.engine.engine import Engine
from cobali.engine.outputs import RequestOutput
from cobali.engine.plan import TickRecord
from cobali.latency import summarize
from cobali.offline import LLM
from cobali.workloads import WorkItem

try:
    import resource
except ImportError:  # Windows: no resource module, and `import cobali` (even --help) must not fail there
    resource = None  # type: ignore[assignment]


@dataclass
class RunResult:
    outputs: list[RequestOutput]  # each request's final (whole) output, in workload order
    wall_s: float
    user_cpu_s: float
    ticks: list[TickRecord]

    def summary(self) -> dict:
        return {**summarize(self.outputs, self.wall_s, self.user_cpu_s), **tick_stats(self.ticks)}


def tick_stats(ticks: Sequence[TickRecord]) -> dict:
    """Scheduler-side figures: ticks, batch sizes, wasted slots, and host time around llama_decode."""
    if not ticks:
        return {"ticks": 0}
    tick_s = np.array([t.end - t.start for t in ticks])
    host_s = np.array([t.host_s for t in ticks])
    return {
        "ticks": len(ticks),
        "mean_batch_tokens": float(np.mean([t.plan.n_tokens for t in ticks])),
        "wasted_decode_slots": int(sum(t.plan.wasted_slots for t in ticks)),
        "host_ms_per_tick": float(host_s.mean() * 1e3),
        "host_share": float(host_s.sum() / tick_s.sum()),
    }


def user_cpu_seconds() -> float:
    """This process's user CPU time: getrusage's microseconds where it exists, else os.times' coarser clock."""
    if resource is None:
        return os.times().user
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def run_workload(
    engine: Engine,
    items: Sequence[WorkItem],
    max_new: int,
    ignore_eos: bool = False,
    progress: str | None = "requests",
    trace_steps: bool = False,
) -> RunResult:
    """Submit every item at once (offline), run to completion; the final outputs in workload order."""
    start_ticks = len(engine.ticks)
    cpu0, wall0 = user_cpu_seconds(), time.perf_counter()
    llm = LLM(engine)
    keys = [llm.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens or max_new, ignore_eos=ignore_eos),
                       arrival_time=wall0) for item in items]
    bar = tqdm(total=len(keys), desc=progress, unit="req", leave=False, disable=progress is None)
    if trace_steps:
        engine.on_tick = lambda t: bar.write(
            f"tick {t.plan.tick}: {t.plan.describe()}, {(t.end - t.start) * 1e3:.1f} ms")
    finished: dict[Hashable, RequestOutput] = {}
    try:
        for key, output in llm.run():
            finished[key] = output
            bar.update()
    finally:
        engine.on_tick = None
        bar.close()
    wall = time.perf_counter() - wall0
    return RunResult([finished[key] for key in keys], wall, user_cpu_seconds() - cpu0, engine.ticks[start_ticks:])
