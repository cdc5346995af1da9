"""`cobali serve --replicas 2`: two engines on the embedded model behind one Ray Serve endpoint, driven by the
official openai client. Each replica runs --threads 1 and reserves one of the machine's two cores.

With --engine-process each replica's engine runs in a child process of the replica's Ray actor: a kill -9 of one
ends that replica's running stream with the restart's error and nothing else (the other replica's stream runs on,
new requests are handed on to it while the engine reloads), the replica gets a new engine, and after a SIGTERM
no engine process is left."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from cobali.frontend.client import ENGINE_RESTARTED
from tests.integration.test_server_openai import running_server

pytest.importorskip("ray.serve")

N_REQUESTS = 16


def served_per_replica(base: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "cobali:request_success_total":
                replica = sample.labels["replica"]
                counts[replica] = counts.get(replica, 0) + sample.value
    return counts


def stream_one(client: OpenAI, i: int) -> str | None:
    """Half completions, half chats, all streamed; returns the finish reason of the last chunk."""
    if i % 2:
        chunks = list(client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=8, stream=True))
    else:
        chunks = list(client.completions.create(model="smol", prompt=f"{i}, {i + 1},", max_tokens=8, stream=True))
    return chunks[-1].choices[0].finish_reason


@pytest.mark.timeout(240)  # starts a local Ray cluster (several processes): 20-30 s on 2 cores
def test_two_replicas_share_concurrent_streams() -> None:
    with running_server("--replicas", "2", "--max-slots", "4", "--served-model-name", "smol",
                        "--shutdown-grace", "5") as (base, proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(N_REQUESTS) as pool:
            reasons = list(pool.map(lambda i: stream_one(client, i), range(N_REQUESTS)))
        assert all(reason in ("length", "stop") for reason in reasons), reasons

        raw = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=60)
        assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")
        bad = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": -1}, timeout=60)
        assert bad.status_code == 400

        counts = served_per_replica(base)
        assert sum(counts.values()) == N_REQUESTS + 1, counts
        assert sorted(counts) == ["0", "1"] and min(counts.values()) > 0, counts  # both replicas served
        assert httpx.get(f"{base}/health", timeout=30).json()["replicas"] == {"0": "ok", "1": "ok"}
    assert proc.returncode == 0  # SIGTERM: Serve drained and Ray shut down


# --replicas 2 --engine-process: each replica's engine in a child process of the replica's Ray actor.
LONG = 128  # tokens: a stream this long is still running when the engine beside it is killed
HANG_S = 60.0  # every wait's bound: far beyond any step here, so a hang fails the test instead of freezing it


def process_table() -> dict[int, tuple[int, str]]:
    """Every live process (zombies left out): pid -> (parent's pid, command line)."""
    table = {}
    for entry in Path("/proc").iterdir():
        try:
            pid, stat, cmdline = int(entry.name), (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
        except (OSError, ValueError):  # not a process (/proc/self among them), or gone meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after the command's name, which may hold spaces
        if state != "Z":
            table[pid] = (int(ppid), cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return table


def descendants(table: dict[int, tuple[int, str]], root: int) -> set[int]:
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier}
        found |= frontier
    return found


def replica_children(server_pid: int) -> dict[str, dict[int, str]]:
    """Each engine replica's actor (named by its deployment, which Ray puts in its process title) with the processes
    it started and their command lines: the engine's own and multiprocessing's resource tracker."""
    table = process_table()
    tree = descendants(table, server_pid)
    actors = {pid: table[pid][1].split("ServeReplica:cobali:")[1].split()[0] for pid in tree
              if "ServeReplica:cobali:cobali-engine-" in table[pid][1]}
    found: dict[str, dict[int, str]] = {name: {} for name in actors.values()}
    for pid in tree:
        parent, cmdline = table[pid]
        if parent in actors:
            found[actors[parent]][pid] = cmdline
    return found


def engine_pids(server_pid: int) -> dict[str, int]:
    """Each replica's engine process: the one child its actor spawned through multiprocessing."""
    engines = {}
    for name, children in replica_children(server_pid).items():
        spawned = [pid for pid, cmdline in children.items() if "multiprocessing.spawn" in cmdline]
        assert len(spawned) <= 1, (name, children)
        if spawned:
            engines[name] = spawned[0]
    return engines


def child_pids(server_pid: int) -> set[int]:
    return {pid for children in replica_children(server_pid).values() for pid in children}


def restarts_per_replica(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=HANG_S).text
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "cobali:engine_restarts_total"}


def replica_health(base: str) -> dict[str, str]:
    return httpx.get(f"{base}/health", timeout=HANG_S).json()["replicas"]


def wait_for(condition: Callable[[], bool], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {within_s:.0f} s: {what}"
        time.sleep(0.05)


def long_stream(client: OpenAI, started: threading.Event) -> tuple[str | None, int | None, str | None]:
    """A completion of LONG tokens, streamed: (finish reason, completion tokens, the error event's message)."""
    reason, tokens = None, None
    try:
        for chunk in client.completions.create(model="smol", prompt="Once upon a time", max_tokens=LONG,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                started.set()
            reason = chunk.choices[0].finish_reason if chunk.choices else reason
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
    except openai.APIStatusError:  # an HTTP error status is not what a restart answers
        raise
    except openai.APIError as err:  # the stream's error event
        return reason, tokens, err.message
    return reason, tokens, None


@pytest.mark.timeout(240)  # a local Ray cluster and four engine loads: ~30 s on 2 cores
def test_replicas_run_their_engines_in_processes_of_their_own() -> None:
    with running_server("--replicas", "2", "--engine-process", "--max-slots", "2", "--served-model-name", "smol",
                        "--shutdown-grace", "5") as (base, proc):
        before = engine_pids(proc.pid)
        assert sorted(before) == ["cobali-engine-0", "cobali-engine-1"], replica_children(proc.pid)
        spawned = child_pids(proc.pid)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).choices[0].finish_reason

        # Two streams at once: the gateway sends the second to the replica the first does not busy.
        events = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(long_stream, client, started) for started in events]
            wait_for(lambda: all(e.is_set() for e in events), HANG_S, "both streams have tokens")
            os.kill(before["cobali-engine-0"], signal.SIGKILL)
            assert wait(streams, HANG_S, FIRST_COMPLETED).done  # the stream the kill ended
            # Replica 0 restarts its engine (a backoff of 0.5 s, then the load) and is the less busy one: what
            # comes meanwhile goes there first and is handed on to replica 1.
            assert "restarting" in replica_health(base)["0"]
            reasons = list(pool.map(lambda i: stream_one(client, i), range(4)))
            assert all(reason in ("length", "stop") for reason in reasons), reasons
            outcomes = [s.result(timeout=HANG_S) for s in streams]
        cut, whole = [o for o in outcomes if o[2] is not None], [o for o in outcomes if o[2] is None]
        assert len(cut) == 1 and ENGINE_RESTARTED in str(cut[0][2]), outcomes  # the stream on replica 0
        assert whole == [("length", LONG, None)], outcomes  # the other replica's engine never noticed

        wait_for(lambda: replica_health(base) == {"0": "ok", "1": "ok"}, HANG_S, "replica 0's engine is back")
        assert restarts_per_replica(base) == {"0": 1.0, "1": 0.0}
        after = engine_pids(proc.pid)
        assert after["cobali-engine-1"] == before["cobali-engine-1"], (before, after)
        assert after["cobali-engine-0"] not in (before["cobali-engine-0"], after["cobali-engine-1"]), (before, after)
        spawned |= child_pids(proc.pid)

        served = served_per_replica(base)
        with ThreadPoolExecutor(4) as pool:  # in flight together: least busy spreads them over both replicas
            reasons = list(pool.map(lambda i: stream_one(client, i), range(4)))
        assert all(reason in ("length", "stop") for reason in reasons), reasons
        now = served_per_replica(base)
        assert all(now[r] > served.get(r, 0) for r in ("0", "1")), (served, now)  # both answer, replica 0 too
    assert proc.returncode == 0
    wait_for(lambda: not spawned & process_table().keys(), 10, f"the replicas' processes {spawned} ended")
