"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter), on
the fake backend, where adapter i moves every greedy token by 7 * i."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cobali.backends.base import SamplingParams
from cobali.backends.fake import FakeBackend
from cobali.cli import main
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason
from cobali.server.app import create_app
from cobali.server.engine_thread import EngineState, EngineThread
from cobali.server.errors import APIError
from cobali.server.generation import EngineUnavailable
from cobali.server.state import LoraNames, ServerContext
from tests.unit.test_server_api import wait_healthy

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = "the cat sat on the mat and looked at the dog"


@pytest.fixture
def adapter_file(tmp_path: Path) -> str:
    path = tmp_path / "adapter.gguf"
    path.write_bytes(b"GGUF")  # the fake backend reads no file, it only needs one there
    return str(path)


def engine(**config) -> Engine:
    return Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2, lora_updates=True, **config))


def test_an_adapter_loaded_while_serving_runs_its_requests(adapter_file: str) -> None:
    e = engine()
    index = e.adapters.load(adapter_file)
    base, tuned = e.add_request(PROMPT, PARAMS), e.add_request(PROMPT, PARAMS, lora=index)
    e.run_until_done()
    assert base.output_tokens != tuned.output_tokens
    assert {t.plan.lora for t in e.ticks} == {0, index}
    with pytest.raises(ValueError, match="could not load a LoRA adapter"):
        e.adapters.load(adapter_file + ".missing")


def test_an_unloaded_adapter_finishes_its_requests_then_is_freed(adapter_file: str) -> None:
    e = engine()
    index = e.adapters.load(adapter_file)
    running = e.add_request(PROMPT, PARAMS, lora=index)
    e.step()
    e.adapters.unload(index)
    with pytest.raises(ValueError, match=f"LoRA adapter {index} is not loaded"):
        e.add_request(PROMPT, PARAMS, lora=index)
    assert index in e.backend.loras  # still in use
    e.run_until_done()
    assert running.finish_reason is FinishReason.LENGTH and len(running.output_tokens) == 12
    assert index not in e.backend.loras and e.backend.lora == 0


def test_an_unused_adapter_is_freed_at_once_and_its_index_never_comes_back(adapter_file: str) -> None:
    e = engine()
    first = e.adapters.load(adapter_file)
    request = e.add_request(PROMPT, PARAMS, lora=first)
    e.run_until_done()
    e.adapters.unload(first)
    assert first not in e.backend.loras
    again = e.adapters.load(adapter_file)
    assert again != first
    # The prefix the first one computed is not the second one's (the cache keys KV by adapter index).
    second = e.add_request(PROMPT, PARAMS, lora=again)
    e.run_until_done()
    assert request.cached_tokens == 0 and second.cached_tokens == 0


def test_loading_while_serving_is_refused_with_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async scheduling"):
        engine(async_scheduling=True)


@pytest.fixture
def api() -> Iterator[TestClient]:
    factory = lambda: Engine(FakeBackend(n_seq_max=4, n_loras=1), EngineConfig(max_slots=4, lora_updates=True))  # noqa: E731
    with TestClient(create_app(factory, "base", lora_names=("first",), runtime_lora=True)) as client:
        wait_healthy(client)
        yield client


def complete(api: TestClient, model: str) -> dict:
    return api.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True}).json()


def test_the_routes_load_and_unload_as_vllm_answers(api: TestClient, adapter_file: str) -> None:
    loaded = api.post("/v1/load_lora_adapter", json={"lora_name": "tuned", "lora_path": adapter_file})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'tuned' added successfully."
    assert [c["id"] for c in api.get("/v1/models").json()["data"]] == ["base", "first", "tuned"]
    texts = {model: complete(api, model)["choices"][0]["text"] for model in ("base", "first", "tuned")}
    assert len(set(texts.values())) == 3 and complete(api, "tuned")["model"] == "tuned"
    unloaded = api.post("/v1/unload_lora_adapter", json={"lora_name": "tuned"})
    assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'tuned' removed successfully."
    assert api.post("/v1/completions", json={"model": "tuned", "prompt": "x"}).status_code == 404
    assert [c["id"] for c in api.get("/v1/models").json()["data"]] == ["base", "first"]
    assert complete(api, "first")["choices"][0]["text"] == texts["first"]  # the others are untouched


@pytest.mark.parametrize("route, body, status, message", [
    ("load", {"lora_name": "first", "lora_path": "README.md"}, 400, "'first' has already been loaded"),
    ("load", {"lora_name": "base", "lora_path": "README.md"}, 400, "'base' has already been loaded"),
    ("load", {"lora_name": "new", "lora_path": "/no/such.gguf"}, 400, "from /no/such.gguf"),
    ("load", {"lora_name": "", "lora_path": "README.md"}, 400, "lora_name"),
    ("load", {"lora_name": "new"}, 400, "lora_path"),
    ("unload", {"lora_name": "never"}, 404, "'never' cannot be found"),
    ("unload", {"lora_name": "base"}, 404, "'base' cannot be found"),
])
def test_bad_loads_and_unloads_are_refused_by_name(api: TestClient, route: str, body: dict, status: int,
                                                   message: str) -> None:
    response = api.post(f"/v1/{route}_lora_adapter", json=body)
    assert response.status_code == status and message in response.json()["error"]["message"], response.text


def test_the_routes_are_off_unless_asked_for() -> None:
    factory = lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2))  # noqa: E731
    with TestClient(create_app(factory, "base")) as client:
        wait_healthy(client)
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}).status_code == 404


def test_runtime_updates_are_refused_with_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--allow-runtime-lora-updating", "--replicas", "2"])
    assert exit_info.value.code == 2 and "not with --replicas" in capsys.readouterr().err


def test_a_model_unloaded_while_its_request_was_read_is_a_404_not_the_base_model() -> None:
    server = ServerContext(engine_thread=None, metrics=None, model_name="base",  # type: ignore[arg-type]
                           loras=LoraNames(("first",)))
    assert (server.lora_of("first"), server.lora_of("base"), server.lora_of(None)) == (1, 0, 0)
    server.loras.index.pop("first")  # as /v1/unload_lora_adapter does, between a handler's check and its submit
    with pytest.raises(APIError) as error:
        server.lora_of("first")
    assert error.value.status == 404


@pytest.mark.parametrize("ending, message", [("crash", "boom"), ("stop", "shutting down")])
def test_calls_waiting_for_the_engine_thread_end_with_it(ending: str, message: str) -> None:
    """A load or unload queued when the engine thread dies or stops is answered (503), never left waiting."""
    thread = EngineThread(lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2)))
    thread.start()
    gate = threading.Event()

    def held_tick() -> None:
        gate.wait(10)
        if ending == "crash":
            raise RuntimeError("boom")

    async def scenario() -> None:
        while thread.state is not EngineState.READY:
            await asyncio.sleep(0.01)
        await thread.call(lambda engine: setattr(engine, "step", held_tick))
        thread.submit([([1, 2, 3], PARAMS)])  # its tick holds the engine thread
        await asyncio.sleep(0.05)
        waiting = thread.call(lambda engine: engine.adapters.enabled)
        stopping = asyncio.create_task(asyncio.to_thread(thread.stop)) if ending == "stop" else None
        await asyncio.sleep(0.05)
        gate.set()
        with pytest.raises(EngineUnavailable, match=message):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(EngineUnavailable):
            thread.call(lambda engine: None)
        if stopping is not None:
            await stopping

    try:
        asyncio.run(scenario())
    finally:
        thread.stop()
