"""Event-loop lag while the server reads multi-megabyte JSON bodies (issue 36): the worst lag /metrics reports
around each body, and the worst latency of a GET /health polled beside it.

    .venv/bin/python bench/serving/parse_lag.py                        # this checkout
    .venv/bin/python bench/serving/parse_lag.py --source /path/to/src  # other sources (`git archive <rev> | tar -x`)
    .venv/bin/python bench/serving/parse_lag.py --scale 0.001 --only detokenize --repeat 1   # the smallest run (CI)

Loop lag: /metrics' worst-lag gauge once the body was sent (in brackets: after the warm-up alone). A fresh
server for each body runs the fake backend in a child process (uvicorn, as `cobali serve` runs it), so nothing
but the server's own work holds its loop; each body is sent `--repeat` times. A body over a limit is refused with
a 400 once parsed and measured: the parse is what this measures, not the work the body would ask for.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import logging, sys, uvicorn
from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.frontend.transports import ThreadCore
from cobali.frontend.client import EngineClient
from cobali.http.app import create_app
from cobali.http.config import ServerConfig
app = create_app(ServerConfig(served_model_name="fake", max_queue=None),
                 EngineClient(ThreadCore(lambda: Engine(FakeBackend(n_seq_max=4, n_ctx_seq=4096, n_batch=64),
                                             EngineConfig(max_slots=4, n_batch=64)))))
logging.disable(logging.WARNING)  # a body of unknown fields is logged once per request
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""
LAG_MAX = re.compile(r"^cobali:event_loop_lag_max_seconds (\S+)$", re.M)


def bodies(scale: float = 1.0) -> dict[str, tuple[str, bytes]]:
    """Each body's route and bytes; `scale` shrinks every count in them (the names keep the full sizes)."""
    def encode(value: object) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    def n(full: int) -> int:
        return max(1, round(full * scale))

    enum = [f"value-{i:06d}-{'x' * 16}" for i in range(n(100_000))]
    return {
        "json_schema, 100k-value enum": ("/v1/completions", encode(
            {"prompt": "x", "max_tokens": 1, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "enum": enum}}}})),
        "guided_choice, 200k choices": ("/v1/completions", encode(
            {"prompt": "x", "max_tokens": 1, "guided_choice": [f"choice-{i:07d}" for i in range(n(200_000))]})),
        "chat, one 3.9 MB message": ("/v1/chat/completions", encode(
            {"messages": [{"role": "user", "content": "word " * n(780_000)}], "max_tokens": 1})),
        "chat, 100k messages": ("/v1/chat/completions", encode(
            {"messages": [{"role": "user", "content": "hi"}] * n(100_000), "max_tokens": 1})),
        "responses, 100k input items": ("/v1/responses", encode(
            {"input": [{"role": "user", "content": "hi"}] * n(100_000), "max_output_tokens": 1})),
        "completions, 250k unknown fields": ("/v1/completions", encode(
            {"prompt": "x", "max_tokens": 1, **{f"k{i:07d}": 1 for i in range(n(250_000))}})),
        "detokenize, 1M token ids": ("/detokenize", encode({"tokens": [7] * n(1_000_000)})),
    }


def health_worst_ms(client: httpx.Client, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        client.get("/health")
        out.append(time.perf_counter() - start)
        time.sleep(0.005)


def measure(base: str, path: str, body: bytes, repeat: int) -> tuple[float, int]:
    """(worst /health latency in ms, the reply's status) over `repeat` sends of the body."""
    worst_health, status = 0.0, 0
    with httpx.Client(base_url=base, timeout=60) as client, httpx.Client(base_url=base, timeout=60) as poller:
        for _ in range(repeat):
            stop = threading.Event()
            latencies: list[float] = []
            watcher = threading.Thread(target=health_worst_ms, args=(poller, stop, latencies))
            watcher.start()
            status = client.post(path, content=body, headers={"content-type": "application/json"}).status_code
            time.sleep(0.05)  # a last lag observation after the reply
            stop.set()
            watcher.join()
            worst_health = max(worst_health, max(latencies, default=0.0) * 1e3)
    return worst_health, status


def lag_max_ms(base: str) -> float:
    found = LAG_MAX.search(httpx.get(f"{base}/metrics", timeout=30).text)
    assert found, "/metrics has no event-loop lag gauge"
    return float(found.group(1)) * 1e3


@contextlib.contextmanager
def serving(source: str, port: int) -> Iterator[str]:
    """A fresh server for each body: /metrics' worst-lag gauge is then that body's (after a warm-up)."""
    server = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], cwd=source,
                              env={**os.environ, "PYTHONPATH": source})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _healthy(base):
            assert time.monotonic() < deadline and server.poll() is None, "the server did not start"
            time.sleep(0.2)
        for _ in range(5):  # warm: first requests import and build what later ones reuse
            httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        server.wait(10)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=str(ROOT), help="the sources the server runs (default: this checkout)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--scale", type=float, default=1.0, help="every body's counts times this (0.001: tiny)")
    parser.add_argument("--only", default="", help="a regex: only the bodies whose name it finds")
    args = parser.parse_args()
    print(f"{'body':32} {'MB':>5} {'status':>6} {'lag max ms (warm-up)':>21} {'/health worst ms':>17}")
    for name, (path, body) in bodies(args.scale).items():
        if not re.search(args.only, name):
            continue
        with serving(args.source, args.port) as base:
            warm = lag_max_ms(base)
            health, status = measure(base, path, body, args.repeat)
            worst = lag_max_ms(base)
        print(f"{name:32} {len(body) / 1e6:5.2f} {status:6d} {worst:13.0f} ({warm:4.0f}) {health:17.0f}", flush=True)


if __name__ == "__main__":
    main()
