"""Reliability over a live uvicorn and the slowed fake backend: a soak with cancellations leaks nothing, a
failed decode fails only its batch, an engine crash turns into errors and a 503 health, and a shutdown under
load ends every request cleanly."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from cobali.engine.engine import Engine
from cobali.frontend.client import ENGINE_FAILED
from tests.unit.http.test_server_live import LONG, first_event, live_server, stream, wait_for

ROOT = Path(__file__).resolve().parents[3]


def soak_module() -> ModuleType:
    """bench/serving/soak.py is a script, not part of the package: load it by path (registered, for dataclasses)."""
    if "cobali_bench_soak" not in sys.modules:
        spec = importlib.util.spec_from_file_location("cobali_bench_soak", ROOT / "bench" / "serving" / "soak.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["cobali_bench_soak"]


soak = soak_module()


def engine_of(server) -> Engine:
    engine = server.config.app.state.server.client.transport.engine
    assert engine is not None
    return engine


def arm_decode_failure(engine: Engine) -> None:
    """Fail one decode call soon. Not the next index: a call may be in flight (sleeping in SlowBackend)
    and already counted, or about to be; the one after it is certainly in the future."""
    backend = engine._backend
    backend.fail_on_calls = {len(backend.batches) + 1}


def sse_error(lines) -> str:
    """Reads a stream to its end; the message of its error event (an empty string if there was none)."""
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line and line != "data: [DONE]"]
    return events[-1].get("error", {}).get("message", "") if events else ""


def test_soak_with_cancellations_leaks_nothing() -> None:
    options = soak.SoakOptions(requests=200, concurrency=64, max_tokens=8, time_limit_s=50)
    with live_server(max_slots=16) as (client, _server):
        report = soak.soak(str(client.base_url), options)
    print("\n".join(report.lines(options.requests)))
    assert report.lost == 0, report.reasons
    assert report.outcomes["failed"] == 0, report.reasons
    assert report.outcomes["completed"] + report.outcomes["cancelled"] == 200
    assert 25 <= report.outcomes["cancelled"] <= 75  # 25% of 200, give or take the draw
    assert report.leaked_slots == 0
    assert report.residue == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}


def test_a_failed_decode_fails_its_batch_and_the_engine_keeps_serving() -> None:
    with live_server(max_slots=1) as (client, server), stream(client, LONG) as hog:
        first_event(hog)  # holds the only slot: every decode call is its batch
        waiter: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: waiter.append(client.post(
            "/v1/completions", json={"prompt": "w", "max_tokens": 3, "ignore_eos": True})))
        thread.start()
        wait_for(lambda: engine_of(server)._scheduler.waiting)
        arm_decode_failure(engine_of(server))
        assert "injected failure" in sse_error(hog)
        thread.join(10)
        assert waiter[0].status_code == 200 and waiter[0].json()["usage"]["completion_tokens"] == 3
        assert client.get("/health").status_code == 200
        # A whole (non-streamed) request in a failing batch: an HTTP error with the reason.
        arm_decode_failure(engine_of(server))
        failed = client.post("/v1/completions", json={"prompt": "f", "max_tokens": 50, "ignore_eos": True})
        assert failed.status_code == 503 and "injected failure" in failed.json()["error"]["message"]
        after = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
        assert after.status_code == 200


def test_no_kv_slot_for_a_lone_request_fails_it_cleanly() -> None:
    """llama.cpp's code 1 with nothing to preempt: the request fails, the next one runs."""
    with live_server(max_slots=1) as (client, server), stream(client, LONG) as hog:
        first_event(hog)
        engine_of(server)._backend.fail_code = 1
        arm_decode_failure(engine_of(server))
        assert "no KV slot" in sse_error(hog)
        assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_an_engine_crash_ends_open_streams_and_health_says_503(caplog: pytest.LogCaptureFixture) -> None:
    """Clients are told that the engine failed, never its exception's text: that is the log's."""
    with live_server() as (client, server), stream(client, LONG) as lines:
        first_event(lines)

        def crash(*_args: object) -> None:
            raise RuntimeError("the GPU fell off")

        engine_of(server)._backend.decode = crash
        assert sse_error(lines) == ENGINE_FAILED
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == ENGINE_FAILED
        refused = client.post("/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["message"] == ENGINE_FAILED
        assert "the GPU fell off" in caplog.text


# How requests not yet taken end when the server stops: refused by the draining engine, or at the socket
# (a new connection refused, or an idle keep-alive connection closed as the request went out).
TURNED_AWAY = ("HTTP 503", "connection refused", "connection closed before a response")


def shutdown_under_load(grace_s: float, max_tokens: int, min_done: int) -> soak.SoakReport:
    """Runs 120 streams (16 at a time); the shutdown signal comes once min_done have ended and the slots
    are busy."""
    options = soak.SoakOptions(requests=120, concurrency=16, max_tokens=max_tokens, cancel_fraction=0.25,
                               time_limit_s=40)
    report = soak.SoakReport()
    with live_server(max_slots=8, grace_s=grace_s) as (client, server):
        load = threading.Thread(target=lambda: asyncio.run(soak.run_load(str(client.base_url), options, report)))
        load.start()
        wait_for(lambda: sum(report.outcomes.values()) >= min_done
                 and len(engine_of(server)._scheduler.running) >= 4, timeout_s=20)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        load.join(30)
        assert not load.is_alive()
    print(report.outcomes, report.reasons)
    assert sum(report.outcomes.values()) == 120
    assert report.lost == 0, report.reasons
    return report


def test_shutdown_under_load_lets_in_flight_requests_finish() -> None:
    report = shutdown_under_load(grace_s=10, max_tokens=8, min_done=20)
    assert report.outcomes["completed"] >= 20
    # What was not in flight is turned away cleanly: a 503 while draining, or a refused connection.
    assert set(report.reasons) <= set(TURNED_AWAY), report.reasons


def test_shutdown_under_load_past_the_grace_period_ends_streams_with_an_error() -> None:
    report = shutdown_under_load(grace_s=0.2, max_tokens=400, min_done=0)
    assert report.outcomes["failed"] > 0
    allowed = (*TURNED_AWAY, "SSE error: the request was aborted: the server is shutting down")
    assert set(report.reasons) <= set(allowed), report.reasons
