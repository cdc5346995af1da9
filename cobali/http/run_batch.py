"""`cobali run-batch -i requests.jsonl -o results.jsonl`: a file in OpenAI's Batch API format, run offline on one
engine, as `vllm run-batch` runs it.

Each input line is {"custom_id", "method": "POST", "url", "body"}, url one of URLS. The bodies go through the
server's own routes in this process (no socket), so every field, check and error is the server's. Each output line
is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}, written and flushed as
its request finishes (a 4xx or 5xx keeps its error body there). A rerun after a kill skips the custom_ids already
answered in the output, but for a server error's (5xx: the engine failed, or was shutting down), which it runs
again; the command exits 1 while any are left. Results do not depend on the order lines finish in, but a request's
numbers may on what shared its batch (`cobali batch` runs prompts in fixed shards where that matters).
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from fastapi import FastAPI

from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.interface import EngineSetup
from cobali.harness.results_file import ResultsFile
from cobali.http.config import ServerConfig
from cobali.http.protocol.bodies import unencodable_text
from cobali.http.serve import build_app

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def read_batch(path: str | Path) -> list[BatchLine]:
    """Every line, checked before anything runs: ValueError naming the first bad one."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file not found: {path}")
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for n, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if text.strip():
            line = _batch_line(text, f"{path} line {n}")
            if line.custom_id in seen:
                raise ValueError(f"{path} line {n}: custom_id {line.custom_id!r} appears twice")
            seen.add(line.custom_id)
            lines.append(line)
    return lines


def _batch_line(text: str, where: str) -> BatchLine:
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("custom_id"), str) or not entry["custom_id"]:
        raise ValueError(f"{where}: expected an object with a non-empty string 'custom_id'")
    if unencodable_text(entry["custom_id"]) is not None:  # it is written back out, as UTF-8
        raise ValueError(f"{where}: custom_id must be valid Unicode (a lone surrogate cannot be encoded as UTF-8)")
    if entry.get("method", "POST") != "POST":
        raise ValueError(f"{where}: method {entry['method']!r}: only POST")
    if entry.get("url") not in URLS:
        raise ValueError(f"{where}: url {entry.get('url')!r}: expected one of {', '.join(URLS)}")
    if not isinstance(entry.get("body"), dict):
        raise ValueError(f"{where}: 'body' must be a JSON object")
    if entry["body"].get("stream"):
        raise ValueError(f"{where}: stream is not supported in a batch")
    return BatchLine(entry["custom_id"], entry["url"], entry["body"])


async def run_batch(app: FastAPI, lines: list[BatchLine], out: IO[str], concurrency: int,
                    on_done: Callable[[], None] | None = None) -> int:
    """Run the lines through the app's routes, `concurrency` at a time; each result appended to `out` as it
    comes. Returns how many were written: all of them (a route's crash is its line's 500)."""
    async with app.router.lifespan_context(app):
        await _until_ready(app.state.server.client)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://cobali", timeout=None) as client:
            todo = iter(lines)

            async def worker() -> None:
                for line in todo:  # shared: each line goes to the first worker free
                    # As a client sends it: escaped, so text the body's checks refuse (a lone surrogate) is the
                    # line's 400, not a crash of the batch while encoding it.
                    response = await client.post(line.url, content=json.dumps(line.body),
                                                 headers={"content-type": "application/json"})
                    out.write(json.dumps(output_record(line, response), ensure_ascii=False) + "\n")
                    out.flush()
                    if on_done is not None:
                        on_done()

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(lines)))))
    return len(lines)


async def _until_ready(client: EngineClient) -> None:
    """The model loads on the engine thread: wait for it however long it takes, and fail with its error if it
    cannot load."""
    while client.state is EngineState.LOADING:
        await asyncio.sleep(0.05)
    if client.state is not EngineState.READY:
        raise ValueError(f"the engine is not available: {client.error or client.state.value}")


def output_record(line: BatchLine, response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": response.status_code, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


def is_final(record: dict[str, Any]) -> bool:
    """A result a rerun keeps: all but a server error's (5xx: the engine failed, or was shutting down), whose line
    runs again. A 4xx is the line's own answer, as in vLLM."""
    response = record.get("response")
    return not (isinstance(response, dict) and isinstance(status := response.get("status_code"), int)
                and status >= 500)


def run_batch_file(spec: EngineSetup, settings: ServerConfig, input_path: str, output_path: str,
                   concurrency: int) -> int:
    """The command: what is left of the input, run and appended to the output. Exit status 1 if lines got a
    server error (a rerun runs them again)."""
    lines = read_batch(input_path)
    results = ResultsFile(Path(output_path), "custom_id", is_final)
    done = results.finished_ids()
    todo = [line for line in lines if line.custom_id not in done]
    results.append("run-batch", "requests", len(lines), len(todo), lambda out, on_done: asyncio.run(
        run_batch(build_app(spec, settings), todo, out, concurrency, on_done)))
    failed = [line.custom_id for line in todo if line.custom_id not in results.finished_ids()]
    if failed:
        print(f"cobali run-batch: {len(failed)} of {len(lines)} requests failed with a server error (5xx), the first "
              f"{failed[0]!r}: rerun the command to run them again", file=sys.stderr)
        return 1
    return 0
