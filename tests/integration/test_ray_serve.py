"""`cobali serve --replicas 2`: one deployment of two engine replicas on the embedded model behind one Ray Serve
endpoint, routed by our request router, driven by the official openai client. Each replica runs --threads 1 and
reserves one of the machine's two cores. Replicas are named by Ray Serve's replica ids in /metrics and /health.

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
from tests.integration.test_server_openai import running_server, soak_module

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


def both_ready(base: str) -> None:
    deadline = time.monotonic() + 120  # far beyond a replica's load (seconds): a hang fails here
    while list(httpx.get(f"{base}/health", timeout=60).json()["replicas"].values()) != ["ok", "ok"]:
        assert time.monotonic() < deadline, "both replicas ready"
        time.sleep(0.1)


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
        both_ready(base)  # /health answers 200 once one replica is: the other may still be loading
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
        # No prompt shares a block with another: the kv router routed by load, and both replicas served.
        assert len(counts) == 2 and min(counts.values()) >= N_REQUESTS // 4, counts
        assert list(httpx.get(f"{base}/health", timeout=30).json()["replicas"].values()) == ["ok", "ok"]
    assert proc.returncode == 0  # SIGTERM: Serve drained and Ray shut down


SYSTEM = "You are a careful assistant for a bookshop. " + " ".join(f"Rule {i}: answer in one line." for i in range(40))


def router_counts(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {s.labels["how"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "cobali:router_requests_total"}


@pytest.mark.timeout(240)
def test_a_shared_prefix_goes_back_to_the_replica_that_holds_it() -> None:
    with running_server("--replicas", "2", "--max-slots", "2", "--served-model-name", "smol",
                        "--routing-stats-period", "0.2", "--shutdown-grace", "5") as (base, _proc):
        both_ready(base)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)

        def ask(question: str) -> int:
            reply = client.chat.completions.create(
                model="smol", max_tokens=2, messages=[{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": question}])
            details = reply.usage.prompt_tokens_details if reply.usage else None
            return (details.cached_tokens or 0) if details else 0

        ask("Do you sell maps?")
        before = served_per_replica(base)
        time.sleep(1.0)  # the replicas report what they hold (every 0.2 s)
        cached = [ask(f"Question {i}: do you open on day {i}?") for i in range(6)]
        after = served_per_replica(base)
        grew = {replica: after[replica] - before.get(replica, 0) for replica in after}
        assert [n for n in grew.values() if n] == [6], (before, after)  # all on the replica holding the prefix
        assert min(cached) >= 256, cached  # and its KV reused
        assert router_counts(base)["prefix"] >= 6



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


def replica_children(server_pid: int) -> dict[int, dict[int, str]]:
    """Each engine replica's actor (by pid: the replicas of one deployment share its name in their process
    titles) with the processes it started and their command lines: the engine's own and multiprocessing's resource
    tracker."""
    table = process_table()
    tree = descendants(table, server_pid)
    actors = [pid for pid in tree if "ServeReplica:cobali:cobali-engine" in table[pid][1]]
    found: dict[int, dict[int, str]] = {actor: {} for actor in actors}
    for pid in tree:
        parent, cmdline = table[pid]
        if parent in found:
            found[parent][pid] = cmdline
    return found


def engine_pids(server_pid: int) -> dict[int, int]:
    """Each replica's engine process (by its actor's pid): the one child its actor spawned through
    multiprocessing."""
    engines = {}
    for actor, children in replica_children(server_pid).items():
        spawned = [pid for pid, cmdline in children.items() if "multiprocessing.spawn" in cmdline]
        assert len(spawned) <= 1, (actor, children)
        if spawned:
            engines[actor] = spawned[0]
    return engines


def child_pids(server_pid: int) -> set[int]:
    return {pid for children in replica_children(server_pid).values() for pid in children}


def restarts_per_replica(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=HANG_S).text
    return {s.labels["replica"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "cobali:engine_restarts_total"}


def replica_health(base: str) -> list[str]:
    return sorted(httpx.get(f"{base}/health", timeout=HANG_S).json()["replicas"].values())


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
    # Routed by requests in flight: the kv router may put two prefix-less streams together once the first's
    # prompt is computed (a tie on work), and this test is about the engines' processes, not the routing.
    with running_server("--replicas", "2", "--engine-process", "--max-slots", "2", "--served-model-name", "smol",
                        "--shutdown-grace", "5", "--router", "least-busy") as (base, proc):
        both_ready(base)
        before = engine_pids(proc.pid)
        assert len(before) == 2, replica_children(proc.pid)
        killed, other = sorted(before)
        spawned = child_pids(proc.pid)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        assert client.completions.create(model="smol", prompt="Hi", max_tokens=2).choices[0].finish_reason

        # Two streams, the second sent once the first has tokens: the router then counts the first's work on its
        # replica and sends the second to the other (sent at once, both could be chosen before either is counted).
        events = [threading.Event(), threading.Event()]
        with ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(long_stream, client, events[0])]
            wait_for(events[0].is_set, HANG_S, "the first stream has tokens")
            streams.append(pool.submit(long_stream, client, events[1]))
            wait_for(lambda: all(e.is_set() for e in events), HANG_S, "both streams have tokens")
            busy = {row["replica"] for row in httpx.get(f"{base}/slots", timeout=HANG_S).json() if row["is_processing"]}
            assert len(busy) == 2, busy  # one stream on each: the engine killed holds one, whichever it is
            os.kill(before[killed], signal.SIGKILL)
            assert wait(streams, HANG_S, FIRST_COMPLETED).done  # the stream the kill ended
            # That replica restarts its engine (a backoff of 0.5 s, then the load) and is the less busy one: what
            # comes meanwhile may go there first and is handed on to the other.
            assert any("restarting" in state for state in replica_health(base))
            reasons = list(pool.map(lambda i: stream_one(client, i), range(4)))
            assert all(reason in ("length", "stop") for reason in reasons), reasons
            outcomes = [s.result(timeout=HANG_S) for s in streams]
        cut, whole = [o for o in outcomes if o[2] is not None], [o for o in outcomes if o[2] is None]
        assert len(cut) == 1 and ENGINE_RESTARTED in str(cut[0][2]), outcomes  # the stream on the killed engine
        assert whole == [("length", LONG, None)], outcomes  # the other replica's engine never noticed

        wait_for(lambda: replica_health(base) == ["ok", "ok"], HANG_S, "the killed engine is back")
        assert sorted(restarts_per_replica(base).values()) == [0.0, 1.0]
        after = engine_pids(proc.pid)
        assert after[other] == before[other], (before, after)
        assert after[killed] not in (before[killed], after[other]), (before, after)
        spawned |= child_pids(proc.pid)

        served = served_per_replica(base)
        with ThreadPoolExecutor(4) as pool:  # in flight together: the load spreads them over both replicas
            reasons = list(pool.map(lambda i: stream_one(client, i), range(8)))
        assert all(reason in ("length", "stop") for reason in reasons), reasons
        now = served_per_replica(base)
        in_flight = [line for line in httpx.get(f"{base}/metrics", timeout=HANG_S).text.splitlines()
                     if "router_in_flight" in line]
        assert len(now) == 2 and all(now[r] > served.get(r, 0) for r in now), (served, now, in_flight)  # both answer
    assert proc.returncode == 0
    wait_for(lambda: not spawned & process_table().keys(), 10, f"the replicas' processes {spawned} ended")


@pytest.mark.timeout(300)  # a local Ray cluster in this process, replicas loaded three times
def test_replicas_added_and_removed_under_load_lose_no_request() -> None:
    """serve.run again with another --replicas while streams run (Ray Serve makes it a new version: replicas of it
    start, the old ones stop taking requests and drain): two replicas become one, then two again, and every stream
    ends well."""
    import ray
    from ray import serve

    from cobali.ray.serve import APP_NAME, build

    port = soak_module().free_port()
    base = f"http://127.0.0.1:{port}"

    def deploy(replicas: int) -> None:
        options = {"replicas": str(replicas), "threads": "1", "max-slots": "2", "served-model-name": "smol",
                   "shutdown-grace": "10"}
        serve.run(build(options), name=APP_NAME, route_prefix="/")  # returns once every replica is running

    def listed() -> int:
        reply = httpx.get(f"{base}/health", timeout=HANG_S)
        return len(reply.json()["replicas"]) if reply.status_code == 200 else 0

    ray.init(address="local", include_dashboard=False, num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        deploy(2)  # 2 first: `replicas` > 1 is what makes a Ray deployment; then down to 1 and up again
        wait_for(lambda: listed() == 2, HANG_S, "two replicas listed")
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        stop, outcomes = threading.Event(), []

        def keep_streaming(worker: int) -> None:
            i = worker
            while not stop.is_set():
                try:
                    outcomes.append(stream_one(client, i))
                except Exception as err:  # a lost request: what this test looks for
                    outcomes.append(repr(err))
                i += 3

        with ThreadPoolExecutor(3) as pool:
            workers = [pool.submit(keep_streaming, w) for w in range(3)]
            deploy(1)
            wait_for(lambda: listed() == 1, HANG_S, "one replica listed")
            deploy(2)
            wait_for(lambda: listed() == 2, HANG_S, "two replicas listed again")
            stop.set()
            for worker in workers:
                worker.result(timeout=HANG_S)
        assert len(outcomes) >= 3 and all(o in ("length", "stop") for o in outcomes), outcomes
    finally:
        serve.shutdown()
        ray.shutdown()
