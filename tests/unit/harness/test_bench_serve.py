"""`cobali bench serve`: SSE parsing and client-side timing against a mocked httpx transport."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
from pathlib import Path
from unittest import mock

import httpx
import pytest

from cobali.faces import bench as bench_cli
from cobali.faces import cli
from cobali.harness.serve_client import ClientRecord, ServeOptions, apply_chunk, endpoints, run_serve, sse_data
from cobali.harness.workloads import WorkItem


class FakeServer:
    """An OpenAI-style /v1/completions that streams `texts` one chunk per `delay` seconds."""

    def __init__(self, texts: list[str], delay: float = 0.0, usage: bool = True, status: int = 200) -> None:
        self.texts, self.delay, self.usage, self.status = texts, delay, usage, status
        self.bodies: list[dict] = []
        self.headers: list[httpx.Headers] = []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served-model"}]})
        assert request.url.path == "/v1/completions"
        self.bodies.append(json.loads(request.content))
        self.headers.append(request.headers)
        if self.status != 200:
            return httpx.Response(self.status, text="model overloaded")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._events())

    async def _events(self):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        yield b": keep-alive comment\n\n"
        for text in self.texts:
            await asyncio.sleep(self.delay)
            yield _event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
        # A closing chunk with no text: must not count as a token or an inter-token gap.
        yield _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if self.usage:
            n = 2 * len(self.texts)
            yield _event({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n,
                                                   "total_tokens": 4 + n}})
        # Counted as done before the last event: the client stops reading at [DONE], so code after
        # this yield would only run when the generator is garbage-collected.
        self.in_flight -= 1
        yield b"data: [DONE]\n\n"


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def serve(server: FakeServer, n: int = 1, **options) -> list[ClientRecord]:
    items = [WorkItem(f"prompt {i}") for i in range(n)]
    opts = ServeOptions(url="http://bench.test:8000", **options)
    result = asyncio.run(run_serve(items, opts, transport=httpx.MockTransport(server), progress=False))
    return result.records


def test_sse_lines_and_chunks() -> None:
    assert sse_data("data: {\"a\": 1}") == "{\"a\": 1}"
    assert sse_data(": comment") is None and sse_data("") is None and sse_data("event: x") is None
    record = ClientRecord(0)
    assert apply_chunk(record, '{"choices": [{"text": "Hi"}]}', 1.0)
    assert apply_chunk(record, '{"choices": [{"text": ""}]}', 2.0)  # a token without text
    assert apply_chunk(record, '{"choices": [{"text": "", "finish_reason": "length"}]}', 2.5)  # no token
    assert not apply_chunk(record, "[DONE]", 3.0)
    assert record.text == "Hi" and record.chunk_times == [1.0, 2.0]
    assert not apply_chunk(record, '{"error": {"message": "bad"}}', 4.0)
    assert "bad" in record.error


def test_endpoints_accept_root_v1_or_full_url() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/completions"):
        assert endpoints(url) == ("http://h:1/v1/completions", "http://h:1/v1/models")
    with pytest.raises(ValueError, match="'h:1'"):
        endpoints("h:1")


def test_streams_measure_ttft_itl_and_count_tokens_from_usage() -> None:
    server = FakeServer(["a", "b", "c"], delay=0.03)
    (record,) = serve(server, max_new=6, api_key="sekret")
    assert record.error is None and record.text == "abc"
    assert (record.prompt_tokens, record.output_tokens) == (4, 6)  # from usage, not the 3 chunks
    timing = record.timing()
    assert timing.ttft_ms >= 25 and len(timing.itl_ms) == 2 and min(timing.itl_ms) >= 25
    # TPOT spreads the time after the first chunk over the 5 later tokens the usage reports.
    assert timing.tpot_ms == pytest.approx(sum(timing.itl_ms) / 5)
    body = server.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "served-model"  # the first one /v1/models lists
    assert server.headers[0]["authorization"] == "Bearer sekret"


def test_without_usage_output_tokens_are_counted_from_chunks() -> None:
    (record,) = serve(FakeServer(["x", "y"], usage=False), model="given")
    assert record.output_tokens == 2 and record.prompt_tokens == 0


def test_http_errors_are_recorded_per_request_and_counted_as_failed() -> None:
    items = [WorkItem("p")] * 2
    result = asyncio.run(run_serve(items, ServeOptions(url="http://bench.test"),
                                   transport=httpx.MockTransport(FakeServer([], status=503)), progress=False))
    assert all(r.error.startswith("HTTP 503") and "overloaded" in r.error for r in result.records)
    summary = result.summary()
    assert summary["failed"] == 2 and summary["generated_tokens"] == 0 and summary["ttft_p50_ms"] is None


def test_concurrency_caps_requests_in_flight() -> None:
    server = FakeServer(["a", "b"], delay=0.01)
    records = serve(server, n=6, concurrency=2)
    assert len(records) == 6 and all(r.error is None for r in records)
    assert server.max_in_flight == 2


def test_serve_subcommand_prints_the_table_and_writes_files(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\n")
    server = FakeServer(["a", "b"])
    patched = functools.partial(run_serve, transport=httpx.MockTransport(server), progress=False)
    out = io.StringIO()
    with mock.patch.object(bench_cli, "run_serve", patched), contextlib.redirect_stdout(out):
        code = cli.main(["bench", "serve", "--url", "http://bench.test:8000", "--prompts", str(prompts),
                         "--concurrency", "2", "--max-new", "4", "--model", "m",
                         "--out", str(tmp_path / "r")])
    assert code == 0
    rows = [line.split() for line in out.getvalue().splitlines() if line.startswith("bench.test:8000")]
    assert len(rows) == 1 and rows[0][6] == "1.00"
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["runs"][0]["requests"] == 3 and summary["runs"][0]["generated_tokens"] == 12
    assert [b["model"] for b in server.bodies] == ["m"] * 3
    assert (tmp_path / "r" / "latency_cdf.png").read_bytes().startswith(b"\x89PNG")
