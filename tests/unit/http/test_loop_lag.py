"""The event-loop lag monitor: a blocked loop shows up as lag in /metrics, and an idle one as next to none."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, generate_latest

from cobali.http.loop_lag import LoopLagMonitor


def test_a_blocked_loop_is_measured_and_an_idle_one_is_not() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.01)

    async def run() -> None:
        monitor.start()
        await asyncio.sleep(0.2)
        assert monitor.max_s < 0.1  # idle (on a busy CI machine a wake-up may still be a few ms late)
        time.sleep(0.15)  # what a regex or a tokenization on the loop does to every request
        await asyncio.sleep(0.05)
        await monitor.stop()

    asyncio.run(run())
    assert 0.12 <= monitor.max_s < 1.0
    text = generate_latest(registry).decode()
    assert "cobali:event_loop_lag_max_seconds" in text
    count = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("cobali:event_loop_lag_seconds_count")))
    assert count >= 5
    fast = float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith('cobali:event_loop_lag_seconds_bucket{le="0.1"}')))
    assert fast < count  # the wake-up after the block came late by the blocked time


def test_stop_without_start_and_twice() -> None:
    monitor = LoopLagMonitor(CollectorRegistry())

    async def run() -> None:
        await monitor.stop()
        monitor.start()
        await monitor.stop()
        await monitor.stop()

    asyncio.run(run())
