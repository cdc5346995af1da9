"""`cobali run-batch -i requests.jsonl -o results.jsonl`: a file in OpenAI's Batch API format, run offline on one
engine, as `vllm run-batch` runs it.

Each input line is {"custom_id", "method": "POST", "url", "body"}, url one of URLS. The bodies go through the
server's own routes in this process (no socket), so every field, check and error is the server's. Each output line
is {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}, written and flushed as
its request finishes (a 4xx keeps its error body there). A rerun after a kill skips the custom_ids already in the
output. Results do not depend on the order lines finish in, but a request's numbers may on what shared its batch
(`cobali batch` runs prompts in fixed shards where that matters).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from fastapi import FastAPI
from tqdm import tqdm

from cobali.config import EngineSpec
from cobali.jsonl import drop_cut_line, finished_ids
from cobali.server.config import ServerConfig
from cobali.server.serve import build_app

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
LOAD_TIMEOUT_S = 600.0


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
    comes. Returns how many were written."""
    gate = asyncio.Semaphore(concurrency)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://cobali", timeout=None) as client:
            await _until_ready(client)

            async def one(line: BatchLine) -> None:
                async with gate:
                    response = await client.post(line.url, json=line.body)
                out.write(json.dumps(output_record(line, response), ensure_ascii=False) + "\n")
                out.flush()
                if on_done is not None:
                    on_done()

            await asyncio.gather(*(one(line) for line in lines))
    return len(lines)


async def _until_ready(client: httpx.AsyncClient) -> None:
    """The model loads on the engine thread: wait for it, and fail with its error if it cannot load."""
    deadline = asyncio.get_running_loop().time() + LOAD_TIMEOUT_S
    while True:
        health = await client.get("/health")
        if health.status_code == 200:
            return
        message = health.json()["error"]["message"]
        if "failed" in message or asyncio.get_running_loop().time() > deadline:
            raise ValueError(f"the engine is not available: {message}")
        await asyncio.sleep(0.05)


def output_record(line: BatchLine, response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    request_id = body.get("id") if isinstance(body, dict) else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": response.status_code, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


def run_batch_file(spec: EngineSpec, settings: ServerConfig, input_path: str, output_path: str,
                   concurrency: int) -> int:
    """The command: what is left of the input, run and appended to the output."""
    lines = read_batch(input_path)
    done = finished_ids(output_path, "custom_id")
    todo = [line for line in lines if line.custom_id not in done]
    print(f"cobali run-batch: {len(lines)} requests, {len(lines) - len(todo)} already in {output_path}, "
          f"{len(todo)} to run")
    if not todo:
        return 0
    drop_cut_line(output_path)
    app = build_app(spec, settings)
    with open(output_path, "a", encoding="utf-8") as out, \
            tqdm(total=len(lines), initial=len(lines) - len(todo), unit="req", desc="run-batch") as bar:
        written = asyncio.run(run_batch(app, todo, out, concurrency, bar.update))
    print(f"wrote {written} results to {output_path}")
    return 0
