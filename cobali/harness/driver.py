"""One workload through one engine, closed or open loop, run to completion, with metrics. `cobali run`,
`cobali bench` and the benchmark scripts measure through it."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from cobali.engine.engine import Engine
from cobali.engine.outputs import RequestOutput
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.harness.latency import summarize
from cobali.harness.workloads import WorkItem

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
    idle_after: frozenset[int] = frozenset()  # ticks (of `ticks`) after which the engine slept for an arrival

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


@dataclass(frozen=True)
class LoadOptions:
    """How a workload arrives: every request at the start (closed loop, offline), or each at its offset."""

    max_new: int = 64
    ignore_eos: bool = False
    request_rate: float = float("inf")  # inf: every request arrives at the start (offline)
    arrival_offsets: tuple[float, ...] = ()  # per request, seconds after the start; used when rate is finite

    def offsets(self, n_items: int) -> Sequence[float]:
        return [0.0] * n_items if math.isinf(self.request_rate) else self.arrival_offsets


def run_workload(engine: Engine, items: Sequence[WorkItem], load: LoadOptions, progress: str | None = "requests",
                 trace_steps: bool = False, sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """The one driver of a workload through an engine: each request submitted when its arrival time passes
    (all at once when the load is offline), the engine stepped in between, so TTFT includes the time a request
    queues behind the ones already running. Time is the engine's clock; `sleep` waits on it (a simulated clock
    passes its own). The final outputs, in workload order."""
    clock, start_tick = engine.clock, len(engine.ticks)
    cpu0, wall0 = user_cpu_seconds(), clock()
    arrivals = [wall0 + t for t in load.offsets(len(items))]
    assert len(arrivals) == len(items), "an arrival offset per request"
    llm, keys = LLM(engine), list[Hashable]()
    finished: dict[Hashable, RequestOutput] = {}
    idle_after: set[int] = set()
    bar = tqdm(total=len(items), desc=progress, unit="req", leave=False, disable=progress is None)
    if trace_steps:
        engine.on_tick = lambda t: bar.write(
            f"tick {t.plan.tick}: {t.plan.describe()}, {(t.end - t.start) * 1e3:.1f} ms")
    try:
        while len(keys) < len(items) or llm.has_work:
            now = clock()
            while len(keys) < len(items) and arrivals[len(keys)] <= now:
                item = items[len(keys)]
                params = SamplingParams(max_tokens=item.max_tokens or load.max_new, ignore_eos=load.ignore_eos)
                keys.append(llm.submit(item.prompt, params, arrival_time=arrivals[len(keys)]))
            if llm.has_work:
                done = llm.step()
                finished.update(done)
                bar.update(len(done))
            elif len(keys) < len(items):
                # Nothing to run: the host gap until the next tick is waiting, not overhead.
                idle_after.add(len(engine.ticks) - 1 - start_tick)
                sleep(max(0.0, arrivals[len(keys)] - clock()))
    finally:
        engine.on_tick = None
        bar.close()
    return RunResult([finished[key] for key in keys], clock() - wall0, user_cpu_seconds() - cpu0,
                     engine.ticks[start_tick:], frozenset(idle_after))
