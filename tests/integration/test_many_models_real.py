"""`cobali serve --models` with two models (the embedded one under two names), through the official openai client
(issue 48): each loads on demand in an engine process of its own, and a kill -9 of one model's engine costs that
model a restart while the other's streams go on untouched."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from cobali.backends.embedded_model import embedded_model_path
from tests.integration.test_engine_process_real import HANG_S, children, running, wait_for
from tests.integration.test_server_openai import running_server

pytestmark = pytest.mark.slow  # a server and three model loads: run by .ci/run, not by `make test`

MAX_TOKENS = 48  # long enough that the kill lands while model b's streams run


def engine_pids(server_pid: int) -> set[int]:
    """Its models' engines, by the name each gives its process: not the spare that waits for the next load."""
    return {pid for pid in children(server_pid) if process_name(pid) == "cobali-engine"}


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # gone meanwhile
        return ""


def stream_text(client: OpenAI, model: str) -> str:
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to fifty."}],
                                            max_tokens=MAX_TOKENS, stream=True,
                                            extra_body={"ignore_eos": True})
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_a_crash_of_one_models_engine_leaves_the_other_serving() -> None:
    path = embedded_model_path()
    with running_server("--models", f"a={path}", f"b={path}", "--max-slots", "4", "--ctx", "2048") as (base, proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        assert stream_text(client, "a")
        (pid_a,) = engine_pids(proc.pid)
        assert stream_text(client, "b")
        (pid_b,) = engine_pids(proc.pid) - {pid_a}
        with ThreadPoolExecutor(4) as pool:
            streams_b = [pool.submit(stream_text, client, "b") for _ in range(4)]
            wait_for(lambda: any(row["model"] == "b" and row["is_processing"]
                                 for row in httpx.get(f"{base}/slots").json()), HANG_S, "b's streams running")
            os.kill(pid_a, signal.SIGKILL)
            assert all(len(future.result(HANG_S)) > 0 for future in streams_b)  # none of b's failed
        assert running(pid_b)
        wait_for(lambda: pid_a not in engine_pids(proc.pid) and len(engine_pids(proc.pid)) == 2, HANG_S,
                 "a's engine restarted")
        deadline = time.monotonic() + HANG_S
        while True:  # a answers again once its new engine has loaded: a 503 meanwhile says it restarts
            try:
                assert stream_text(client, "a")
                break
            except Exception:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        metrics = httpx.get(f"{base}/metrics").text
        assert 'cobali:engine_restarts_total{model="a"} 1.0' in metrics
        assert 'cobali:engine_restarts_total{model="b"} 0.0' in metrics
        models = {card["id"]: card for card in httpx.get(f"{base}/models").json()["data"]}
        assert models["a"]["status"]["value"] == models["b"]["status"]["value"] == "loaded"
