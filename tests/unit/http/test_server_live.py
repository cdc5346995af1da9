"""Behaviour that needs real sockets (queue limits, disconnects, graceful shutdown): uvicorn in a thread,
over a fake backend slowed to ~5 ms a decode so requests stay in flight long enough to observe."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.http.serve import DrainingServer
from tests.unit.http.test_server_api import fake_app

# Every test on both tick loops: synchronous, and with async scheduling (a decode thread beside the engine's).
pytestmark = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])

LONG = {"prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}


class SlowBackend(FakeBackend):
    def decode(self, tokens, positions, seq_ids, want_logits):
        time.sleep(0.005)
        return super().decode(tokens, positions, seq_ids, want_logits)


@contextmanager
def live_server(max_slots: int = 2, max_queue: int | None = None, grace_s: float = 10,
                overlap: bool = False) -> Iterator[tuple[httpx.Client, uvicorn.Server]]:
    def build() -> Engine:
        return Engine(SlowBackend(n_seq_max=max_slots, n_ctx_seq=4096, n_batch=64),
                      EngineConfig(max_slots=max_slots, n_batch=64, async_scheduling=overlap))

    app = fake_app(build, "slow", max_queue=max_queue)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=10)
    server = DrainingServer(config, on_exit=lambda: app.state.server.client.drain(grace_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
        try:
            yield client, server
        finally:
            server.should_exit = True
            thread.join(15)
    assert not thread.is_alive()


def wait_for(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextmanager
def stream(client: httpx.Client, body: dict) -> Iterator[Iterator[str]]:
    """A streamed completion's SSE lines; leaving the block closes the connection (a client disconnect)."""
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        yield response.iter_lines()


def busy_slots(client: httpx.Client) -> int:
    return sum(s["is_processing"] for s in client.get("/slots").json())


def first_event(lines: Iterator[str]) -> dict:
    """Reads from the response's line iterator, which the caller keeps: dropping it closes the connection."""
    line = next(line for line in lines if line)
    return json.loads(line.removeprefix("data: "))


def metric(client: httpx.Client, sample: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def test_beyond_the_queue_limit_is_429(overlap: bool) -> None:
    with live_server(overlap=overlap, max_slots=1, max_queue=0) as (client, _), stream(client, LONG) as hog:
        first_event(hog)  # it holds the only slot now
        response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert client.post("/v1/completions", json={**LONG, "max_tokens": 1}).status_code == 429


def test_a_waiting_request_is_admitted_when_a_slot_frees(overlap: bool) -> None:
    with live_server(overlap=overlap, max_slots=1, max_queue=1) as (client, _):
        with stream(client, {**LONG, "max_tokens": 40}) as hog:
            first_event(hog)
            waiter = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert waiter.status_code == 200
        assert waiter.json()["usage"]["completion_tokens"] == 2


def test_client_disconnect_frees_the_slot(overlap: bool) -> None:
    with live_server(overlap=overlap) as (client, _):
        with stream(client, LONG) as response:
            first_event(response)
            assert busy_slots(client) == 1
        wait_for(lambda: busy_slots(client) == 0, timeout_s=5)
        wait_for(lambda: metric(client, 'cobali:request_success_total{finished_reason="abort"}') == 1)


def test_disconnect_while_queued_drops_the_request(overlap: bool) -> None:
    with live_server(overlap=overlap, max_slots=1) as (client, _), stream(client, LONG) as hog:
        first_event(hog)
        with pytest.raises(httpx.ReadTimeout):  # waits behind the hog, then gives up
            client.post("/v1/completions", json={"prompt": "q", "max_tokens": 5}, timeout=0.3)
        wait_for(lambda: metric(client, 'cobali:request_success_total{finished_reason="abort"}') == 1)
        assert metric(client, "cobali:num_requests_waiting") == 0
        assert busy_slots(client) == 1


def test_shutdown_signal_lets_in_flight_requests_finish(overlap: bool) -> None:
    with live_server(overlap=overlap) as (client, server), stream(client, {**LONG, "max_tokens": 100}) as lines:
        first_event(lines)
        server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        assert client.get("/health").status_code == 503  # out of rotation at once
        rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


def test_requests_still_running_after_the_grace_period_get_an_error(overlap: bool) -> None:
    with live_server(overlap=overlap, grace_s=0.2) as (client, server), stream(client, LONG) as lines:
        first_event(lines)
        server.handle_exit(signal.SIGTERM, None)
        *_, error, end = [line for line in lines if line]
        assert "shutting down" in json.loads(error.removeprefix("data: "))["error"]["message"]
        assert end == "data: [DONE]"  # after the error, the stream's end, as vLLM's streams do
