"""`cobali run-batch`: OpenAI's Batch API file format through the server's own routes, on the fake backend."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.server.app import create_app
from cobali.server.run_batch import BatchLine, read_batch, run_batch

LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
    {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": "the cat", "max_tokens": 4, "temperature": 0}},
    {"custom_id": "bad-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
    {"custom_id": "other-model", "method": "POST", "url": "/v1/completions", "body": {"model": "nope", "prompt": "x"}},
]


def write(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def run(lines: list[BatchLine], concurrency: int = 2) -> dict[str, dict]:
    app = create_app(lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2)), "m", max_queue=None)
    out = io.StringIO()
    assert asyncio.run(run_batch(app, lines, out, concurrency)) == len(lines)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    return {r["custom_id"]: r for r in records}


def test_every_line_gets_the_servers_answer_in_openais_batch_output(tmp_path: Path) -> None:
    results = run(read_batch(write(tmp_path / "in.jsonl", LINES)))
    assert set(results) == {"chat-1", "text-1", "bad-1", "other-model"}
    chat, text = results["chat-1"]["response"], results["text-1"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["object"] == "chat.completion"
    assert chat["request_id"] == chat["body"]["id"] and results["chat-1"]["error"] is None
    assert text["body"]["usage"]["completion_tokens"] == 4
    assert results["bad-1"]["response"]["status_code"] == 400
    assert "max_tokens" in results["bad-1"]["response"]["body"]["error"]["message"]
    assert results["other-model"]["response"]["status_code"] == 404
    assert all(r["id"].startswith("batch_req_") for r in results.values())


def test_many_lines_run_through_a_few_at_a_time(tmp_path: Path) -> None:
    lines = [{"custom_id": f"n{i}", "url": "/v1/completions", "body": {"prompt": f"p{i}", "max_tokens": 2}}
             for i in range(12)]
    results = run(read_batch(write(tmp_path / "in.jsonl", lines)), concurrency=3)
    assert sorted(results) == sorted(f"n{i}" for i in range(12))
    assert {r["response"]["status_code"] for r in results.values()} == {200}


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 1: not JSON"),
    ({"url": "/v1/completions", "body": {}}, "non-empty string 'custom_id'"),
    ({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}, "method 'GET': only POST"),
    ({"custom_id": "a", "url": "/v1/files", "body": {}}, "url '/v1/files'"),
    ({"custom_id": "a", "url": "/v1/completions", "body": []}, "'body' must be a JSON object"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"stream": True}}, "stream is not supported"),
])
def test_a_bad_line_stops_the_batch_before_it_runs(tmp_path: Path, line, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_batch(write(tmp_path / "in.jsonl", [line]))


def test_a_custom_id_twice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="custom_id 'chat-1' appears twice"):
        read_batch(write(tmp_path / "in.jsonl", [LINES[0], LINES[0]]))


def test_a_model_that_cannot_load_ends_the_batch_with_its_error() -> None:
    def broken() -> Engine:
        raise ValueError("could not load a GGUF model from x.gguf")

    app = create_app(broken, "m", max_queue=None)
    line = BatchLine("a", "/v1/completions", {"prompt": "x"})
    with pytest.raises(ValueError, match=r"loading failed: could not load a GGUF model from x\.gguf"):
        asyncio.run(asyncio.wait_for(run_batch(app, [line], io.StringIO(), 1), 10))
