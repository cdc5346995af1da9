"""What a short streamed request costs the server (issue 46): the generating routes skip FastAPI's dependency
solving, and a message's finished requests reach /metrics in one batch that counts exactly what one at a time
would."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from cobali.engine.outputs import RequestStats
from cobali.frontend.interface import FinishReason, RequestOutput
from cobali.http import prometheus
from cobali.http.request_route import RequestRoute
from tests.unit.http.test_server_api import fake_app, fake_engine, sse_payloads, wait_healthy


@pytest.fixture
def api() -> Iterator[TestClient]:
    with TestClient(fake_app(fake_engine())) as client:
        wait_healthy(client)
        yield client


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
])
def test_generating_routes_skip_fastapis_dependency_solving(api: TestClient, monkeypatch: pytest.MonkeyPatch,
                                                            path: str, body: dict) -> None:
    def solving(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("FastAPI solved a generating route's dependencies")

    monkeypatch.setattr("fastapi.routing.solve_dependencies", solving)
    response = api.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    assert sse_payloads(response.text)
    # The app's own exception handlers still answer: a bad body is FastAPI's 400, a wrong method its 405.
    assert api.post(path, json={"max_tokens": "many"}).status_code == 400
    assert api.get(path).status_code == 405


def test_a_request_route_takes_the_request_alone() -> None:
    router = APIRouter(route_class=RequestRoute)

    async def with_query(http: Request, n: int) -> None: ...

    with pytest.raises(TypeError, match="takes the Request alone"):
        router.post("/x")(with_query)
    app = FastAPI()

    @router.post("/ok")
    async def ok(http: Request) -> JSONResponse:
        return JSONResponse({"path": http.url.path})

    app.include_router(router)
    with TestClient(app) as client:  # a route's own answer passes as it came, its handler given the Request
        assert client.post("/ok").json() == {"path": "/ok"}


def test_gaps_within_runs_leave_out_the_gaps_between_them() -> None:
    runs = [(1.0, 1.5), (10.0, 10.25, 11.0, 13.0), (2.0, 2.125, 2.25)]
    expected = [g for run in runs for g in np.diff(run)]
    assert prometheus.gaps_within(runs).tolist() == pytest.approx(expected)
    assert len(prometheus.gaps_within(runs)) == sum(len(run) - 1 for run in runs)


def _final(request_id: int, times: tuple[float, ...], reason: FinishReason) -> RequestOutput:
    stats = RequestStats(arrival_time=0.5, first_scheduled_time=0.6, token_times=times, finish_time=times[-1] + 0.01,
                         n_prompt_tokens=7, n_output_tokens=len(times), cached_tokens=0, preemptions=0)
    return RequestOutput(request_id, "", (), len(times), (), True, 7, 0, finish_reason=reason, stats=stats)


def test_a_batch_of_finished_requests_counts_what_one_at_a_time_would() -> None:
    outputs = [_final(1, (1.0, 1.004, 1.05, 1.3), FinishReason.LENGTH), _final(2, (2.0,), FinishReason.STOP),
               _final(3, (3.0, 3.9), FinishReason.LENGTH), _final(4, (4.0, 4.002, 4.01), FinishReason.ABORT)]
    batched, singly = prometheus.ServerMetrics(), prometheus.ServerMetrics()
    batched.requests_finished(outputs)
    for output in outputs:
        singly.requests_finished([output])
    assert batched.render() == singly.render()
    itl = "cobali:inter_token_latency_seconds"
    assert f'{itl}_count 6.0' in batched.render().decode()  # 3 + 0 + 1 + 2 gaps, none across two requests
    assert 'cobali:request_success_total{finished_reason="length"} 2.0' in batched.render().decode()
