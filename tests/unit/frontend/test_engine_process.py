"""The engine core in a process of its own (cobali/engine/process.py, cobali/frontend/engine_process.py), on the
fake backend: requests and calls through msgpack messages; a kill -9 of the engine's process ends the requests
that had started with a clean error within seconds, runs those that had not (and those sent meanwhile) on the
engine that replaces it; an engine that keeps dying is failed for good; a message it cannot read is dropped."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.frontend.client import ENGINE_FAILED, ENGINE_RESTARTED, EngineClient, EngineState
from cobali.frontend.engine_process import ProcessCore
from cobali.frontend.generation import EngineUnavailable, Generation
from cobali.structured.compiler import GrammarCompiler

READY_WITHIN_S = 60  # a new process imports numpy, llguidance and cobali: seconds on a loaded 2-core VM
ENDED_WITHIN_S = 5  # the bound for every request in flight when the engine dies
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)
LONG = SamplingParams(max_tokens=4000, ignore_eos=True)


class SlowBackend(FakeBackend):
    def decode(self, tokens, positions, seq_ids, want_logits):
        time.sleep(0.005)  # a decode long enough that a request is still running when the test acts
        return super().decode(tokens, positions, seq_ids, want_logits)


def slow_engine(max_slots: int) -> Engine:
    """Built in the engine's process: a module-level function, so that it pickles by name."""
    return Engine(SlowBackend(n_seq_max=max_slots, n_ctx_seq=8192, n_batch=64),
                  EngineConfig(max_slots=max_slots, n_batch=64))


def text_side(model: ModelInfo) -> tuple[Tokenizer, GrammarCompiler]:
    vocabulary = FakeBackend(n_seq_max=1)
    return Tokenizer(vocabulary, model.max_model_len, model.context_hint), GrammarCompiler(
        vocabulary.guidance_tokenizer)


async def until(condition: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def finals(generation: Generation) -> list:
    async def read() -> list:
        return [o async for o in generation.events() if o.finished]

    return await asyncio.wait_for(read(), READY_WITHIN_S)  # a request left waiting fails the test, never hangs it


def run(scenario: Callable[[EngineClient, ProcessCore], Awaitable[None]], max_slots: int = 1, **options) -> None:
    core = ProcessCore(functools.partial(slow_engine, max_slots), lambda: text_side, **options)
    drive(EngineClient(core), core, scenario)


def drive(client: EngineClient, core: ProcessCore,
          scenario: Callable[[EngineClient, ProcessCore], Awaitable[None]]) -> None:
    """The scenario run once the client's engine has loaded (or failed to); the client stopped after it."""

    async def main() -> None:
        client.start()
        try:
            await until(lambda: client.state is not EngineState.LOADING, READY_WITHIN_S)
            await scenario(client, core)
        finally:
            await asyncio.to_thread(client.stop)

    asyncio.run(main())


def test_requests_and_calls_go_through_messages() -> None:
    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        assert client.state is EngineState.READY and client.model_info.max_slots == 2
        done = await finals(client.submit([(client.tokenizer.encode("hello"), SHORT)] * 3))
        assert [o.n_tokens for o in done] == [4, 4, 4] and all(o.stats is not None for o in done)
        assert [s.id for s in await client.slot_states()] == [0, 1]
        with pytest.raises(FileNotFoundError):  # the engine's refusal, raised here as it was there
            await client.load_adapter("/no/such/adapter.gguf")

    run(scenario, max_slots=2)


def test_a_killed_engine_ends_what_ran_and_runs_what_waited_on_the_next() -> None:
    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        running = client.submit([([1, 2, 3], LONG)])
        first = running.events()
        await anext(first)  # it holds the one slot
        waiting = client.submit([([4, 5, 6], SHORT)])
        dead_pid = core.pid
        assert dead_pid is not None
        os.kill(dead_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineUnavailable, match=ENGINE_RESTARTED):
            async for _ in first:
                pass
        assert time.monotonic() - killed_at < ENDED_WITHIN_S
        meanwhile = client.submit([([7, 8], SHORT)])  # while the next engine loads: it waits for it
        assert [o.n_tokens for o in await finals(waiting)] == [4]
        assert [o.n_tokens for o in await finals(meanwhile)] == [4]
        assert client.state is EngineState.READY and core.pid != dead_pid and len(core.restarts) == 1

    run(scenario)


def test_an_engine_that_keeps_dying_is_failed_for_good() -> None:
    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        for _ in range(2):
            await until(lambda: client.state is EngineState.READY, READY_WITHIN_S)
            pid = core.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await until(lambda pid=pid: core.pid != pid or client.state is EngineState.FAILED, READY_WITHIN_S)
        await until(lambda: client.state is EngineState.FAILED, READY_WITHIN_S)
        with pytest.raises(EngineUnavailable, match=ENGINE_FAILED):
            client.require_engine()

    run(scenario, max_restarts=1, first_backoff_s=0.01)


def test_a_message_the_engine_cannot_read_is_dropped_and_it_serves_on() -> None:
    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        with core._send_lock:
            core._outbox.send(b"\x92\xa3not\xc1")  # msgpack of no message type, with a byte msgpack never uses
        assert [o.n_tokens for o in await finals(client.submit([([1, 2], SHORT)]))] == [4]
        assert core.restarts == []

    run(scenario)


def test_the_server_says_restarting_counts_restarts_and_ends_a_stream_in_band() -> None:
    from fastapi.testclient import TestClient

    from cobali.http.app import create_app
    from cobali.http.config import ServerConfig

    core = ProcessCore(functools.partial(slow_engine, 1), lambda: text_side, first_backoff_s=1.0)
    app = create_app(ServerConfig(served_model_name="m"), EngineClient(core))
    with TestClient(app) as http:
        deadline = time.monotonic() + READY_WITHIN_S
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.05)
        with http.stream("POST", "/v1/completions", json={"prompt": "go", "max_tokens": 4000, "ignore_eos": True,
                                                          "stream": True}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # a token: the request runs
            assert core.pid is not None
            os.kill(core.pid, signal.SIGKILL)
            rest = list(lines)
        events = [line for line in rest if line]
        assert "restarting" in events[-2] and '"error"' in events[-2] and events[-1] == "data: [DONE]"
        health = http.get("/health")  # within the 1 s backoff: the next engine has not started yet
        assert health.status_code == 503 and "restarting" in health.text
        assert "cobali:engine_restarts_total 1.0" in http.get("/metrics").text
        # A request that comes meanwhile is taken, and waits for the next engine: no 503 for it.
        late = http.post("/v1/completions", json={"prompt": "go", "max_tokens": 2, "ignore_eos": True})
        assert late.status_code == 200 and late.json()["usage"]["completion_tokens"] == 2, late.text
