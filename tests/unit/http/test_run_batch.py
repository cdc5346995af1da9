"""`cobali run-batch`: OpenAI's Batch API file format through the server's own routes, on the fake backend."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from cobali.backends.fake import FakeBackend
from cobali.config.flags import engine_setup
from cobali.config.serve_flags import run_batch_config
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.faces.cli import build_parser, main
from cobali.http import run_batch as run_batch_module
from cobali.http.run_batch import BatchLine, read_batch, run_batch, run_batch_file
from tests.unit.http.test_server_api import fake_app

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
    app = batch_app()
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

    app = fake_app(broken, "m", max_queue=None)
    line = BatchLine("a", "/v1/completions", {"prompt": "x"})
    with pytest.raises(ValueError, match=r"loading failed: could not load a GGUF model from x\.gguf"):
        asyncio.run(asyncio.wait_for(run_batch(app, [line], io.StringIO(), 1), 10))


def batch_app(crash: str | None = None) -> FastAPI:
    """The server on the fake backend; with `crash`, that route raises (a bug's 500) for every line."""
    app = fake_app(lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2)), "m", max_queue=None)
    if crash is not None:
        def boom() -> None:
            raise RuntimeError("a bug")

        app.router.routes.insert(0, APIRoute(crash, boom, methods=["POST"]))
    return app


def test_a_route_that_raises_is_its_lines_500_and_the_batch_goes_on(tmp_path: Path) -> None:
    lines = read_batch(write(tmp_path / "in.jsonl", LINES[:2] + [
        {"custom_id": f"more-{i}", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}
        for i in range(4)]))
    out = io.StringIO()
    assert asyncio.run(asyncio.wait_for(run_batch(batch_app(crash="/v1/chat/completions"), lines, out, 2), 10)) == 6
    results = {r["custom_id"]: r["response"] for r in map(json.loads, out.getvalue().splitlines())}
    assert len(results) == 6 and results["chat-1"]["status_code"] == 500
    assert results["chat-1"]["body"]["error"]["type"] == "server_error"
    assert {results[k]["status_code"] for k in results if k != "chat-1"} == {200}


def run_file(monkeypatch: pytest.MonkeyPatch, app: FastAPI, source: Path, output: Path) -> int:
    monkeypatch.setattr(run_batch_module, "build_app", lambda _spec, _settings: app)
    return run_batch_file(None, None, str(source), str(output), 2)  # type: ignore[arg-type]


def test_server_errors_fail_the_command_and_run_again_on_a_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A 5xx (the engine failed, a bug) is not the line's answer: exit 1, and a rerun runs it again and keeps
    one result a line. A 4xx is: kept, as in vLLM."""
    source, output = write(tmp_path / "in.jsonl", LINES[:3]), tmp_path / "out.jsonl"
    assert run_file(monkeypatch, batch_app(crash="/v1/chat/completions"), source, output) == 1
    assert "1 of 3 requests failed with a server error (5xx), the first 'chat-1'" in capsys.readouterr().err
    assert run_file(monkeypatch, batch_app(), source, output) == 0
    assert "3 requests, 2 already in" in capsys.readouterr().out
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == ["bad-1", "chat-1", "text-1"]
    assert {r["custom_id"]: r["response"]["status_code"] for r in results} == {"bad-1": 400, "chat-1": 200,
                                                                               "text-1": 200}
    assert run_file(monkeypatch, batch_app(), source, output) == 0
    assert "0 to run" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ('{"id": 1, "text": "a batch output"}\n', "out.jsonl line 1: no 'custom_id'"),
    ('{"custom_id": "a"}\n{"custom_id": "b", cut\n{"custom_id": "c"}\n', "out.jsonl line 2: not JSON"),
    ("[1, 2]\n", "out.jsonl line 1: no 'custom_id'"),
])
def test_an_output_that_is_not_run_batchs_is_an_error_naming_its_line(tmp_path: Path, text: str, message: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    source, output = write(tmp_path / "in.jsonl", LINES[:1]), tmp_path / "out.jsonl"
    output.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["run-batch", "-i", str(source), "-o", str(output)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert output.read_text() == text  # left as it was


def test_an_engine_that_stops_while_loading_ends_the_batch_with_its_state() -> None:
    """The wait reads the engine thread's state, not /health's words: a model that loads slowly is waited for,
    one that will never serve ends the batch."""
    gate = threading.Event()

    def slow() -> Engine:
        gate.wait(10)
        return Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2))

    app = fake_app(slow, "m", max_queue=None)

    async def scenario() -> None:
        batch = asyncio.create_task(run_batch(app, [BatchLine("a", "/v1/completions", {"prompt": "x"})],
                                              io.StringIO(), 1))
        await asyncio.sleep(0.3)  # still loading: still waiting
        assert not batch.done()
        app.state.server.client.drain()
        gate.set()
        with pytest.raises(ValueError, match="the engine is not available: draining"):
            await asyncio.wait_for(batch, 5)

    asyncio.run(scenario())


def test_lora_modules_are_run_batchs_flag_as_serves(tmp_path: Path) -> None:
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF")
    args = build_parser().parse_args(["run-batch", "-i", "in", "-o", "out", "--lora-modules", f"tuned={adapter}"])
    assert run_batch_config(args).lora_modules == (("tuned", str(adapter)),)
    assert engine_setup(args).backend.lora_paths == (str(adapter),)
