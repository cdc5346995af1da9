"""LoRA adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter), on
the fake backend, where adapter i moves every greedy token by 7 * i."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import MAX_ADAPTER_INDEX, FinishReason
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.cli import main
from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.errors import APIError
from cobali.frontend.generation import EngineUnavailable
from cobali.frontend.offline import LLM
from cobali.frontend.transports import ThreadCore
from cobali.http.config import ServerConfig
from cobali.http.state import LoraNames, ServerContext
from tests.unit.http.test_server_api import fake_app, wait_healthy

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
    index = e._adapters.load(adapter_file)
    base, tuned = e.add_request(PROMPT, PARAMS), e.add_request(PROMPT, PARAMS, lora=index)
    list(LLM(e).run())
    assert base.output_tokens != tuned.output_tokens
    assert {t.plan.lora for t in e.ticks} == {0, index}
    with pytest.raises(FileNotFoundError, match=r"No adapter found for .*\.missing"):
        e._adapters.load(adapter_file + ".missing")
    with pytest.raises(ValueError, match=r"could not load a LoRA adapter for this model from README\.md"):
        e._adapters.load("README.md")


def cached_twice(e: Engine, lora: int) -> list[int]:
    """Runs one prompt twice under adapter `lora`: the second finds the first's prefix in the cache."""
    first = e.add_request(PROMPT, PARAMS, lora=lora)
    list(LLM(e).run())
    second = e.add_request(PROMPT, PARAMS, lora=lora)
    list(LLM(e).run())
    assert first.output_tokens == second.output_tokens and second.cached_tokens > 0
    return [first.cached_tokens, second.cached_tokens]


def test_failed_loads_use_up_no_adapter_index(adapter_file: str) -> None:
    """More failed loads than there are indices, then a good one: it gets the first index, and runs."""
    e = engine()
    for _ in range(MAX_ADAPTER_INDEX + 10):
        with pytest.raises(ValueError, match="could not load"):
            e._adapters.load("README.md")
    index = e._adapters.load(adapter_file)
    assert index == 1
    cached_twice(e, index)


def test_the_last_adapter_index_serves_and_one_more_is_refused(adapter_file: str) -> None:
    """The prefix cache keys an adapter's tokens in 32 bits: the last index still fits them, the next load
    is refused (a ValueError: a 400) instead of overflowing them on the engine's thread."""
    e = engine()
    e._backend._next_lora = MAX_ADAPTER_INDEX
    last = e._adapters.load(adapter_file)
    assert last == MAX_ADAPTER_INDEX
    cached_twice(e, last)
    with pytest.raises(ValueError, match=f"has loaded {MAX_ADAPTER_INDEX} LoRA adapters, the most it can"):
        e._adapters.load(adapter_file)
    assert sorted(e._backend.loras) == [last]  # the refused one freed at once
    cached_twice(e, last)


def test_an_unloaded_adapter_finishes_its_requests_then_is_freed(adapter_file: str) -> None:
    e = engine()
    index = e._adapters.load(adapter_file)
    running = e.add_request(PROMPT, PARAMS, lora=index)
    e.step()
    e._adapters.unload(index)
    with pytest.raises(ValueError, match=f"LoRA adapter {index} is not loaded"):
        e.add_request(PROMPT, PARAMS, lora=index)
    assert index in e._backend.loras  # still in use
    list(LLM(e).run())
    assert running.finish_reason is FinishReason.LENGTH and len(running.output_tokens) == 12
    assert index not in e._backend.loras and e._backend.lora == 0


def test_an_unused_adapter_is_freed_at_once_and_its_index_never_comes_back(adapter_file: str) -> None:
    e = engine()
    first = e._adapters.load(adapter_file)
    request = e.add_request(PROMPT, PARAMS, lora=first)
    list(LLM(e).run())
    e._adapters.unload(first)
    assert first not in e._backend.loras
    again = e._adapters.load(adapter_file)
    assert again != first
    # The prefix the first one computed is not the second one's (the cache keys KV by adapter index).
    second = e.add_request(PROMPT, PARAMS, lora=again)
    list(LLM(e).run())
    assert request.cached_tokens == 0 and second.cached_tokens == 0


def test_loading_while_serving_is_refused_with_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async scheduling"):
        engine(async_scheduling=True)


@pytest.fixture
def api() -> Iterator[TestClient]:
    factory = lambda: Engine(FakeBackend(n_seq_max=4, n_loras=1), EngineConfig(max_slots=4, lora_updates=True))  # noqa: E731
    with TestClient(fake_app(factory, "base", lora_modules=(("first", "first.gguf"),), runtime_lora=True)) as client:
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
    # Unlike vLLM's 404 for a missing file: one answer, whether the path exists or not.
    ("load", {"lora_name": "new", "lora_path": "/no/such.gguf"}, 400,
     "Loading lora new failed: /no/such.gguf is not a LoRA adapter this server can load"),
    ("load", {"lora_name": "new", "lora_path": "README.md"}, 400,
     "Loading lora new failed: README.md is not a LoRA adapter this server can load"),
    ("load", {"lora_name": "", "lora_path": "README.md"}, 400, "lora_name"),
    ("load", {"lora_name": "new"}, 400, "lora_path"),
    ("unload", {"lora_name": "never"}, 404, "'never' cannot be found"),
    ("unload", {"lora_name": "base"}, 404, "'base' cannot be found"),
])
def test_bad_loads_and_unloads_are_refused_by_name(api: TestClient, route: str, body: dict, status: int,
                                                   message: str) -> None:
    response = api.post(f"/v1/{route}_lora_adapter", json=body)
    assert response.status_code == status and message in response.json()["error"]["message"], response.text
    assert response.json()["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    loras = api.app.state.server.loras
    assert not loras.reserved and loras.names() == ("first",)  # a failed load leaves its name free


def test_a_load_past_the_last_adapter_index_is_a_400_and_the_engine_serves_on(api: TestClient,
                                                                              adapter_file: str) -> None:
    api.app.state.server.client.transport.engine._backend._next_lora = MAX_ADAPTER_INDEX + 1
    refused = api.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter_file})
    assert refused.status_code == 400 and "restart the server to load more" in refused.json()["error"]["message"]
    assert complete(api, "first")["choices"][0]["text"] and api.get("/health").status_code == 200


def test_loads_and_unloads_while_the_model_loads_are_503s_that_change_no_name(adapter_file: str) -> None:
    gate = threading.Event()

    def slow() -> Engine:
        gate.wait(10)
        return Engine(FakeBackend(n_seq_max=2, n_loras=1), EngineConfig(max_slots=2, lora_updates=True))

    with TestClient(fake_app(slow, "base", lora_modules=(("first", "first.gguf"),), runtime_lora=True)) as client:
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 503
        assert client.post("/v1/load_lora_adapter",
                           json={"lora_name": "tuned", "lora_path": adapter_file}).status_code == 503
        gate.set()
        wait_healthy(client)
        assert complete(client, "first")["model"] == "first"
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 200
        assert client.post("/v1/load_lora_adapter",
                           json={"lora_name": "tuned", "lora_path": adapter_file}).status_code == 200


def test_a_load_whose_handler_is_cancelled_still_names_its_adapter(adapter_file: str) -> None:
    """The client goes away while the engine thread loads its adapter: the adapter gets its name all the same
    (else it would stay loaded with no name to use or unload it by)."""
    app = fake_app(engine, "base", runtime_lora=True)
    thread: EngineClient = app.state.server.client
    gate = threading.Event()

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            while thread.state is not EngineState.READY:
                await asyncio.sleep(0.01)
            hold_the_engine_thread(thread, gate)  # busy in a tick until the gate opens
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                load = asyncio.create_task(client.post("/v1/load_lora_adapter",
                                                       json={"lora_name": "tuned", "lora_path": adapter_file}))
                await asyncio.sleep(0.1)
                load.cancel()
                gate.set()
                await thread.slot_states()  # answered after the load
                await asyncio.sleep(0.05)
                assert "tuned" in app.state.server.loras and not app.state.server.loras.reserved
                response = await client.post("/v1/completions", json={"model": "tuned", "prompt": "x",
                                                                      "max_tokens": 2})
                assert response.status_code == 200 and response.json()["model"] == "tuned"
            assert load.cancelled()

    asyncio.run(scenario())


def hold_the_engine_thread(thread: EngineClient, gate: threading.Event) -> None:
    """The engine's next tick waits for the gate (a request submitted to make one)."""
    engine = thread.transport.engine
    assert engine is not None
    step = engine.step
    entered = threading.Event()

    def held() -> list:
        entered.set()
        gate.wait(10)
        engine.step = step  # type: ignore[method-assign]
        return step()

    engine.step = held  # type: ignore[method-assign]
    thread.submit([([1, 2, 3], PARAMS)])
    # Until the engine's thread is in that tick: a message sent before it got there would be handled first.
    assert entered.wait(10), "the engine never ticked"


def test_the_routes_are_off_unless_asked_for() -> None:
    factory = lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2))  # noqa: E731
    with TestClient(fake_app(factory, "base")) as client:
        wait_healthy(client)
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "x"}).status_code == 404


def test_runtime_updates_are_refused_with_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--allow-runtime-lora-updating", "--replicas", "2"])
    assert exit_info.value.code == 2 and "not with --replicas" in capsys.readouterr().err


def test_a_model_unloaded_while_its_request_was_read_is_a_404_not_the_base_model() -> None:
    server = ServerContext(ServerConfig(served_model_name="base"), client=None, metrics=None,  # type: ignore[arg-type]
                           pool=None, loras=LoraNames(("first",)))
    assert (server.lora_of("first"), server.lora_of("base"), server.lora_of(None)) == (1, 0, 0)
    server.loras.index.pop("first")  # as /v1/unload_lora_adapter does, between a handler's check and its submit
    with pytest.raises(APIError) as error:
        server.lora_of("first")
    assert error.value.status == 404


@pytest.mark.parametrize("ending, message", [("crash", "the engine failed; see the server log"),
                                             ("stop", "shutting down")])
def test_calls_waiting_for_the_engine_thread_end_with_it(ending: str, message: str) -> None:
    """A load or unload queued when the engine thread dies or stops is answered (503), never left waiting."""
    thread = EngineClient(ThreadCore(lambda: Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2))))
    thread.start()
    gate = threading.Event()

    def held_tick() -> None:
        gate.wait(10)
        if ending == "crash":
            raise RuntimeError("boom")

    async def scenario() -> None:
        while thread.state is not EngineState.READY:
            await asyncio.sleep(0.01)
        engine = thread.transport.engine
        step, engine.step = engine.step, held_tick  # type: ignore[method-assign,union-attr]
        thread.submit([([1, 2, 3], PARAMS)])  # its tick holds the engine thread
        await asyncio.sleep(0.05)
        waiting = thread.slot_states()
        stopping = asyncio.create_task(asyncio.to_thread(thread.stop)) if ending == "stop" else None
        await asyncio.sleep(0.05)
        engine.step = step  # type: ignore[method-assign,union-attr]
        gate.set()
        if ending == "crash":
            with pytest.raises(EngineUnavailable, match=message):
                await asyncio.wait_for(waiting, 5)
        else:  # queued before the stop: answered between the last ticks, or refused by the stop, never left waiting
            with contextlib.suppress(EngineUnavailable):
                await asyncio.wait_for(waiting, 5)
            await stopping
        with pytest.raises(EngineUnavailable, match=message):
            await thread.slot_states()

    try:
        asyncio.run(scenario())
    finally:
        thread.stop()
