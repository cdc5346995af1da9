"""Property-based fuzzing of the server's own OpenAPI spec with schemathesis: every operation, with cases
generated from the spec, must never answer with a 5xx, and the server stays healthy. Slow: `pytest -m slow`.
Derandomized, so CI runs the same cases every time.

Schemathesis's pytest plugin does not run under pytest 9, so the test drives its strategies with hypothesis."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.unit.http.test_server_live import live_server  # noqa: E402


@pytest.mark.slow
def test_no_operation_answers_with_a_server_error() -> None:
    with live_server(max_slots=4) as (client, _server):
        schema = schemathesis.openapi.from_url(str(client.base_url.join("/openapi.json")))
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
            def answers_without_server_error(case) -> None:
                response = case.call(timeout=30)
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:300])

            answers_without_server_error()
        assert client.get("/health").status_code == 200
