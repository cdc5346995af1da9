"""Slow and vanished clients cost nothing: a stream whose client stops reading is dropped after --send-timeout
or once it falls --max-stream-buffer characters behind, and a client that goes away at any phase of its request
(before submit, queued, decoding) has it aborted at once. uvicorn in a thread, raw sockets for the clients."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import uvicorn

from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.cancels import only_our_cancel
from cobali.frontend.generation import Generation, StreamOverflow
from cobali.frontend.interface import RequestOutput
from cobali.http import generation as pipeline
from cobali.http import parse
from cobali.http.routes import completions as openai_routes
from cobali.http.routes import messages as anthropic_routes
from tests.unit.http.test_server_api import fake_app
from tests.unit.http.test_server_live import busy_slots, metric, wait_for

ABORTS = 'cobali:request_success_total{finished_reason="abort"}'
# Long enough (>= 6 s) that a request freed within the tests' waits was aborted, not finished.
LONG = {"prompt": "go", "max_tokens": 3000, "ignore_eos": True}
ROUTES = {
    "completions": ("/v1/completions", LONG),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000,
                                      "ignore_eos": True}),
    "responses": ("/v1/responses", {"input": "go", "max_output_tokens": 3000}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000}),
}


class WideBackend(FakeBackend):
    """~2 ms a decode, 400 characters a token and no end: a stream fills its socket's buffers within a second.
    A prompt's chunk takes 20 ms, so a long prompt's prefill can be caught."""

    def decode(self, tokens, positions, seq_ids, want_logits):
        time.sleep(0.002 if len(tokens) == 1 else 0.02)
        return super().decode(tokens, positions, seq_ids, want_logits)

    def token_bytes(self, token: int) -> bytes:
        return super().token_bytes(token) * 400

    def _logits_after(self, history: list[int]) -> np.ndarray:
        logits = super()._logits_after(history)
        logits[EOG_TOKEN] = -1e9  # never ends early: responses sends no ignore_eos
        return logits


@contextmanager
def live(max_slots: int = 2, **limits: float) -> Iterator[tuple[httpx.Client, int]]:
    def build() -> Engine:
        return Engine(WideBackend(n_seq_max=max_slots, n_ctx_seq=4096, n_batch=64),
                      EngineConfig(max_slots=max_slots, n_batch=64))

    app = fake_app(build, "wide", max_queue=8, **limits)
    listener = socket.socket()
    # Connections inherit this: a small fixed send buffer, where Linux would grow one to megabytes.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
        try:
            yield client, port
        finally:
            server.should_exit = True
            thread.join(15)
            listener.close()


@contextmanager
def request_socket(port: int, path: str, body: dict) -> Iterator[socket.socket]:
    """A client that sends its request and then never reads; leaving the block closes it (a disconnect)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's sends block soon
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
    sock.sendall(head.encode() + b"\r\n" + payload)
    try:
        yield sock
    finally:
        sock.close()


@pytest.mark.parametrize("route", ["completions", "responses", "messages"])
def test_a_stream_whose_client_stops_reading_is_aborted_within_the_send_timeout(route: str, caplog) -> None:
    path, body = ROUTES[route]
    with live(send_timeout_s=0.3, max_stream_buffer_chars=10**9) as (client, port), \
            request_socket(port, path, {**body, "stream": True}):
        wait_for(lambda: busy_slots(client) == 1)
        wait_for(lambda: busy_slots(client) == 0, timeout_s=3)
        assert metric(client, ABORTS) == 1
    assert any("--send-timeout" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_stream_that_falls_too_far_behind_is_aborted() -> None:
    with live(send_timeout_s=60, max_stream_buffer_chars=50_000) as (client, port), \
            request_socket(port, "/v1/chat/completions", {**ROUTES["chat"][1], "stream": True}):
        wait_for(lambda: busy_slots(client) == 1)
        wait_for(lambda: busy_slots(client) == 0, timeout_s=3)  # long before the send timeout
        assert metric(client, ABORTS) == 1


class Owner:
    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)


def test_the_text_a_stuck_stream_holds_is_bounded() -> None:
    async def run() -> None:
        owner = Owner()
        generation = Generation(asyncio.get_running_loop(), owner)
        generation.add(7, 1)
        generation.max_buffered = 1000
        dropped: list[bool] = []
        generation.on_overflow = lambda: dropped.append(True)
        for n in range(1, 10_000):  # nobody reads: the engine goes on decoding into the inbox
            generation.put(RequestOutput(7, "x" * 100, (5,), n, (), False, 1, 0))
        held = sum(len(item.text) for item in generation._inbox if isinstance(item, RequestOutput))
        assert held <= 1000
        assert owner.aborted == [7]
        assert dropped == [True]
        with pytest.raises(StreamOverflow):
            async for _ in generation.batches():
                pass

    asyncio.run(run())


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_goes_while_queued_frees_its_place_at_once(route: str, stream: bool) -> None:
    path, body = ROUTES[route]
    with live(max_slots=1) as (client, port), request_socket(port, "/v1/completions", {**LONG, "stream": True}):
        wait_for(lambda: busy_slots(client) == 1)  # the hog holds the only slot
        with request_socket(port, path, {**body, "stream": stream}):
            wait_for(lambda: metric(client, "cobali:num_requests_waiting") == 1)
        wait_for(lambda: metric(client, "cobali:num_requests_waiting") == 0, timeout_s=1)
        assert metric(client, ABORTS) == 1


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_goes_while_decoding_frees_its_slot_at_once(route: str, stream: bool) -> None:
    path, body = ROUTES[route]
    with live() as (client, port):
        with request_socket(port, path, {**body, "stream": stream}):
            wait_for(lambda: busy_slots(client) == 1)
        wait_for(lambda: busy_slots(client) == 0, timeout_s=1)
        assert metric(client, ABORTS) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_goes_while_its_prompt_is_prefilled_frees_its_slot_at_once(stream: bool) -> None:
    with live() as (client, port):
        with request_socket(port, "/v1/completions", {**LONG, "prompt": "p" * 3000, "max_tokens": 10,
                                                      "stream": stream}):
            wait_for(lambda: client.get("/slots").json()[0]["state"] == "prefill")
        wait_for(lambda: busy_slots(client) == 0, timeout_s=0.3)  # the prefill alone takes a second
        assert metric(client, ABORTS) == 1


def test_a_client_that_goes_before_submit_is_never_submitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler awaits the worker pool (tokenizing, the template, the grammar) before it submits: a client
    gone meanwhile has its handler cancelled there."""
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)  # a short body on the pool too, as a long one is
    preparing, submitted = threading.Event(), threading.Event()
    real_choices, real_submit = openai_routes._completion_choices, pipeline.submit

    def slow_choices(*args, **kwargs):  # on a worker thread
        preparing.set()
        time.sleep(0.5)
        return real_choices(*args, **kwargs)

    def spied_submit(*args, **kwargs):
        submitted.set()
        return real_submit(*args, **kwargs)

    monkeypatch.setattr(openai_routes, "_completion_choices", slow_choices)
    monkeypatch.setattr(pipeline, "submit", spied_submit)
    with live() as (client, port):
        with request_socket(port, "/v1/completions", LONG):
            assert preparing.wait(3)
        time.sleep(0.8)
        assert not submitted.is_set()
        assert busy_slots(client) == 0


def test_a_count_tokens_whose_client_goes_while_it_waits_for_a_worker_never_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """count_tokens holds no slot and streams nothing: what a vanished client can still cost is worker time."""
    counted: list[bool] = []
    real_count = anthropic_routes._prompt_tokens

    def slow_count(*args, **kwargs):  # on a worker thread
        counted.append(True)
        time.sleep(0.5)
        return real_count(*args, **kwargs)

    monkeypatch.setattr(anthropic_routes, "_prompt_tokens", slow_count)
    body = {"messages": [{"role": "user", "content": "go"}]}
    with live() as (_, port), request_socket(port, "/v1/messages/count_tokens", body):
        wait_for(lambda: len(counted) == 1)  # its client's share of the two workers is taken
        with request_socket(port, "/v1/messages/count_tokens", body):
            time.sleep(0.1)  # queued on that share
        time.sleep(1.0)  # the first is done: the second would have run by now
        assert len(counted) == 1


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 counts no cancels")
@pytest.mark.parametrize("others", [0, 1])
def test_a_dropped_stream_swallows_only_its_own_cancel(others: int) -> None:
    """A drop's cancel is withdrawn; a shutdown's that landed with it is still the task's, to end it."""

    async def caught() -> tuple[bool, int]:
        task = asyncio.current_task()
        assert task is not None
        for _ in range(1 + others):
            task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            return only_our_cancel(task), task.cancelling()
        raise AssertionError("not cancelled")

    assert asyncio.run(caught()) == (others == 0, others)
