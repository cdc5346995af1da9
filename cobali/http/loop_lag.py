"""Event-loop lag: how late a timer on the server's loop wakes.

A task sleeps `interval_s` (10 ms) again and again and records how much later than asked it woke. Anything that
holds the loop (a regex, a tokenization, a grammar compiled in a handler) or the GIL shows up here as lag, for
every request at once: the loop that should answer them all was busy. Exposed in /metrics as the histogram
`cobali:event_loop_lag_seconds` and the gauge `cobali:event_loop_lag_max_seconds` (the worst since the start).

Cheap: one timer a period and one histogram observation per wake-up, ~100 a second.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Gauge, Histogram

LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
               60.0)


class LoopLagMonitor:
    """Started on the loop it measures (the app's lifespan) and stopped there."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.max_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self.histogram = Histogram("cobali:event_loop_lag_seconds", "How late a timer on the event loop woke "
                                   f"(asked every {interval_s * 1e3:g} ms): time the loop could serve no one.",
                                   buckets=LAG_BUCKETS, registry=registry)
        Gauge("cobali:event_loop_lag_max_seconds", "The largest event-loop lag seen since the server started.",
              registry=registry).set_function(lambda: self.max_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="cobali-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def record(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)
        self.histogram.observe(lag_s)
        if lag_s > self.max_s:
            self.max_s = lag_s

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.interval_s
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            self.record(loop.time() - due)
