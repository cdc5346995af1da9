"""A request's objects are freed by refcounting, not left to the cyclic collector (issue 46): the server paces that
collector for short-lived objects (cobali.http.collector), and a cycle per request would hold the request's scope,
receive channel and frames until a full collection, whose traversal then cost the server a tenth of its CPU."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from cobali.http.collector import SERVING_THRESHOLD, serving_pace
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy

ROUTES = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
    ("/v1/messages", {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
]


@pytest.fixture(scope="module")
def api() -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine())) as client:
        wait_healthy(client)
        yield client


def cyclic_garbage_of(request: Callable[[], None]) -> list[object]:
    """What request() left that only the cyclic collector could free."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collection finds unreachable is kept in gc.garbage, not freed
    try:
        request()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[path for path, _ in ROUTES])
def test_a_request_leaves_no_cycle_of_the_servers(api: TestClient, path: str, body: dict, stream: bool) -> None:
    def request() -> None:
        response = api.post(path, json={**body, "stream": stream})
        assert response.status_code == 200, response.text

    api.post(path, json={**body, "stream": stream})  # first use's caches filled outside the measured request
    # The test client's own transport (anyio's streams, its thread's futures) leaves cycles of its own: only the
    # server's objects are looked for, and the tasks, frames and scope a cycle of them would hold.
    servers = [type(o).__qualname__ for o in cyclic_garbage_of(request)
               if type(o).__module__.startswith(("cobali.", "starlette.", "fastapi.", "_asyncio"))
               or type(o).__qualname__ in ("AsyncExitStack", "Task")]
    assert servers == []


def test_the_app_paces_the_collector_while_it_runs_and_puts_it_back() -> None:
    before = gc.get_threshold()
    with TestClient(fake_app(fake_engine())):
        assert gc.get_threshold() == (max(SERVING_THRESHOLD, before[0]), *before[1:])
        with serving_pace():  # a second app in the process (a server of many models): the pace holds until the last
            pass
        assert gc.get_threshold()[0] == max(SERVING_THRESHOLD, before[0])
    assert gc.get_threshold() == before
