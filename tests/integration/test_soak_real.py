"""The soak and a shutdown under load against `cobali serve` on the embedded model (--threads 1, see
test_server_openai). The default run keeps them short; the full 2000-request soak is marked slow."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from tests.integration.test_server_openai import running_server
from tests.unit.http.test_reliability import TURNED_AWAY, soak_module

soak = soak_module()


def test_short_soak_on_the_real_model() -> None:
    options = soak.SoakOptions(requests=48, concurrency=16, max_tokens=4, time_limit_s=120)
    with running_server("--max-slots", "8") as (base, proc):
        report = soak.soak(base, options, proc.pid)
    print("\n".join(report.lines(options.requests)))
    assert report.clean, report.reasons
    assert report.outcomes["completed"] + report.outcomes["cancelled"] == 48
    before, after = report.rss_kib
    assert after - before < 64 * 1024


def test_sigterm_under_load_ends_every_request_cleanly_and_exits_0() -> None:
    options = soak.SoakOptions(requests=64, concurrency=16, max_tokens=16, time_limit_s=120)
    report = soak.SoakReport()
    with running_server("--max-slots", "8", "--shutdown-grace", "20") as (base, proc):
        load = threading.Thread(target=lambda: asyncio.run(soak.run_load(base, options, report)))
        load.start()
        deadline = time.monotonic() + 60
        while report.outcomes["completed"] < 8:
            assert time.monotonic() < deadline and load.is_alive()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        load.join(60)
    print(report.outcomes, report.reasons)
    assert sum(report.outcomes.values()) == 64
    assert report.lost == 0, report.reasons
    assert set(report.reasons) <= set(TURNED_AWAY), report.reasons


@pytest.mark.slow
def test_full_soak_script() -> None:
    """The issue's soak: 2000 requests at concurrency 64, max_tokens 8, a quarter cancelled (minutes)."""
    assert soak.main([]) == 0
