"""`cobali serve --engine-process` on the embedded model, through the official openai client (issue 46).

A kill -9 of the engine's process under 32 streams, with fewer slots than streams: the streams that were running
end with a clean error within 5 s, those still queued run on the engine that replaces it, a new request is
answered within the model's load time plus 5 s, and /metrics counts the restart. A SIGTERM still drains the
streams, and leaves no process of the engine's behind."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from cobali.frontend.client import ENGINE_RESTARTED
from tests.integration.test_server_openai import running_server

pytestmark = pytest.mark.slow  # two servers and a restart: run by .ci/run, not by `make test`

STREAMS = 32
SLOTS = 8  # fewer than the streams: most of them are queued when the kill lands
MAX_TOKENS = 24  # a wave of 8 streams takes ~1.3 s here: the kill lands mid-wave, the test ends in ~15 s
KILL_AFTER = 4  # streams that have had tokens when the engine is killed
WITHIN_S = 5.0  # the bound: what ran ends this soon after the kill; the engine serves again load + this
HANG_S = 60.0  # every read's timeout: far beyond any wait here, so a hang fails the test instead of freezing it


@dataclass
class Outcome:
    """One stream, as its client saw it (times from time.monotonic)."""
    first_token_at: float | None = None
    ended_at: float | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from the usage chunk
    error: str | None = None  # the stream's error event, or the 503's message
    saw_done: bool | None = None  # the raw event stream's [DONE] (None: the stream was not read raw)


def children(server_pid: int) -> dict[int, bytes]:
    """The server's child processes and their command lines (the engine's, multiprocessing's resource tracker)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except OSError:  # not a process, or gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid:  # after the command's name, which may hold spaces
            found[int(entry.name)] = cmdline
    return found


def engine_pid(server_pid: int) -> int | None:
    pids = [pid for pid, cmdline in children(server_pid).items() if b"multiprocessing.spawn" in cmdline]
    assert len(pids) <= 1, pids
    return pids[0] if pids else None


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s:.1f} s: {what}"
        time.sleep(0.02)


def stream(client: OpenAI, i: int, outcome: Outcome) -> None:
    """Even i: a chat stream through the SDK's own iterator (the error event raises openai.APIError); odd i: a
    completion's raw event stream through the SDK, which shows the error event and the [DONE] after it."""
    try:
        (chat if i % 2 == 0 else completion)(client, i, outcome)
    except openai.APIStatusError as err:  # refused before the stream began
        assert err.status_code == 503, err
        outcome.error = err.message
    except openai.APIConnectionError:  # a timeout or a dropped connection: not a clean end
        raise
    except openai.APIError as err:
        outcome.error = err.message
    outcome.ended_at = time.monotonic()


ASK: dict[str, Any] = {"model": "smol", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
       "stream_options": {"include_usage": True}, "extra_body": {"ignore_eos": True}}


def chat(client: OpenAI, i: int, outcome: Outcome) -> None:
    with client.chat.completions.create(messages=[{"role": "user", "content": f"Count to {i}."}], **ASK) as chunks:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content and outcome.first_token_at is None:
                outcome.first_token_at = time.monotonic()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome.finish_reason = chunk.choices[0].finish_reason
            if chunk.usage:
                outcome.completion_tokens = chunk.usage.completion_tokens


def completion(client: OpenAI, i: int, outcome: Outcome) -> None:
    with client.completions.with_streaming_response.create(prompt=f"{i} + {i} =", **ASK) as response:
        outcome.saw_done = False
        for line in filter(None, response.iter_lines()):
            assert not outcome.saw_done, f"an event after [DONE]: {line}"
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                outcome.saw_done = True
                continue
            assert outcome.error is None, f"an event after the error event: {line}"
            chunk = json.loads(data)
            if "error" in chunk:
                outcome.error = chunk["error"]["message"]
            for choice in chunk.get("choices") or ():
                if choice["text"] and outcome.first_token_at is None:
                    outcome.first_token_at = time.monotonic()
                outcome.finish_reason = choice["finish_reason"] or outcome.finish_reason
            if chunk.get("usage"):
                outcome.completion_tokens = chunk["usage"]["completion_tokens"]


def ended_after(outcome: Outcome, killed_at: float) -> float:
    assert outcome.ended_at is not None, outcome
    return outcome.ended_at - killed_at


def check_ended_cleanly(outcome: Outcome, killed_at: float) -> None:
    """Complete, or ended with the restart's error within WITHIN_S of the kill; a raw stream, with [DONE]."""
    assert outcome.saw_done is not False, f"no [DONE] at the end of the stream: {outcome}"
    if outcome.error is None:
        assert (outcome.finish_reason, outcome.completion_tokens) == ("length", MAX_TOKENS), outcome
        return
    assert ENGINE_RESTARTED in outcome.error, outcome
    assert ended_after(outcome, killed_at) <= WITHIN_S, outcome


def answered_at(client: OpenAI) -> float:
    """When a short completion came back whole."""
    reply = client.completions.create(model="smol", prompt="Hi", max_tokens=2,
                                      extra_body={"ignore_eos": True, "priority": -1})
    assert reply.choices[0].finish_reason == "length", reply
    return time.monotonic()


def health(base: str, status: int = 200, within_s: float = HANG_S) -> httpx.Response:
    """/health's first answer with this status (AssertionError if none comes within within_s)."""
    deadline = time.monotonic() + within_s
    while (response := httpx.get(f"{base}/health", timeout=HANG_S)).status_code != status:
        assert time.monotonic() < deadline, f"/health not {status} within {within_s:.1f} s: {response.text}"
        time.sleep(0.02)
    return response


def test_a_killed_engine_ends_what_ran_runs_what_waited_and_serves_again() -> None:
    started = time.monotonic()
    with running_server("--engine-process", "--max-slots", str(SLOTS), "--queue", "priority",
                        "--served-model-name", "smol") as (base, proc):
        load_s = time.monotonic() - started  # spawn to /health 200: the frontend's load, then the engine's
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        dead = engine_pid(proc.pid)
        assert dead is not None
        outcomes = [Outcome() for _ in range(STREAMS)]
        with ThreadPoolExecutor(STREAMS + 1) as pool:
            futures = [pool.submit(stream, client, i, outcome) for i, outcome in enumerate(outcomes)]
            wait_for(lambda: sum(o.first_token_at is not None for o in outcomes) >= KILL_AFTER, HANG_S, "tokens")
            had_tokens = {i for i, o in enumerate(outcomes) if o.first_token_at is not None}
            ended = {i for i, o in enumerate(outcomes) if o.ended_at is not None}
            os.kill(dead, signal.SIGKILL)
            killed_at = time.monotonic()
            # Sent as the engine dies: the new engine's first (priority -1 with --queue priority), not behind
            # the queue of 24 streams, so that this times the restart alone.
            fresh = pool.submit(answered_at, client)
            assert "restarting" in health(base, 503, WITHIN_S).text
            health(base, 200, load_s + WITHIN_S)
            for future in futures:
                future.result(timeout=HANG_S)  # a worker's assertion, or a timeout, fails the test here
        mid_flight, queued = had_tokens - ended, set(range(STREAMS)) - had_tokens
        assert mid_flight and queued, "the kill must land with streams both running and waiting"
        for outcome in outcomes:
            check_ended_cleanly(outcome, killed_at)
        for i in had_tokens:  # complete, or ended by the kill within WITHIN_S
            assert ended_after(outcomes[i], killed_at) <= WITHIN_S, outcomes[i]
        assert any(outcomes[i].error for i in mid_flight), "the kill ended no stream mid-flight"
        assert not any(outcomes[i].error for i in ended), "a stream that had ended before the kill failed"
        # Only what the engine had started may fail: the slots the streams with tokens left free at most.
        failed_queued = [i for i in queued if outcomes[i].error]
        assert len(failed_queued) <= SLOTS - len(mid_flight), (failed_queued, mid_flight)
        answered_s = fresh.result(timeout=HANG_S) - killed_at
        assert answered_s <= load_s + WITHIN_S, (answered_s, load_s)
        metrics = httpx.get(f"{base}/metrics", timeout=HANG_S).text
        assert "cobali:engine_restarts_total 1.0" in metrics.splitlines()
        health(base, 200, within_s=0)
        assert engine_pid(proc.pid) not in (None, dead)
    failed_within_s = max(ended_after(o, killed_at) for o in outcomes if o.error)
    print(f"load {load_s:.1f} s; kill to a new request answered {answered_s:.1f} s, to the last error "
          f"{failed_within_s:.2f} s; of {len(mid_flight)} streams "
          f"mid-flight {sum(bool(outcomes[i].error) for i in mid_flight)} failed, of {len(queued)} queued "
          f"{len(queued) - len(failed_queued)} completed")


def test_sigterm_drains_the_streams_and_leaves_no_engine_process() -> None:
    with running_server("--engine-process", "--max-slots", "2", "--served-model-name", "smol") as (base, proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        spawned = children(proc.pid)  # the engine's process, and multiprocessing's resource tracker
        assert engine_pid(proc.pid) is not None
        outcomes = [Outcome() for _ in range(3)]  # two run, one is queued when the SIGTERM lands
        with ThreadPoolExecutor(len(outcomes)) as pool:
            futures = [pool.submit(stream, client, i, outcome) for i, outcome in enumerate(outcomes)]
            wait_for(lambda: any(o.first_token_at is not None for o in outcomes), HANG_S, "tokens")
            proc.send_signal(signal.SIGTERM)
            for future in futures:
                future.result(timeout=HANG_S)
        for outcome in outcomes:
            assert (outcome.error, outcome.finish_reason, outcome.completion_tokens) == (None, "length", MAX_TOKENS)
        assert proc.wait(HANG_S) == 0
        # The resource tracker ends once its pipe closes, a moment after the server: an orphan outlives any wait.
        wait_for(lambda: not [pid for pid in spawned if running(pid)], WITHIN_S,
                 f"the server's children exit: {spawned}")
