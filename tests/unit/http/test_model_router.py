"""Many models behind one endpoint, over the fake backend: each model's app is the one-model server's, its engine
on a thread here (the real server gives each its own process: tests/integration/test_many_models_real.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.setup import EngineSetup
from cobali.frontend.model_table import ModelEntry, ModelPolicy
from cobali.http.config import ServerConfig
from cobali.http.models_app import create_models_app
from cobali.http.models_config import ModelsConfig, ServedModel
from tests.unit.http.test_server_api import fake_app, fake_engine

MiB = 2**20


def served(name: str, size: int = 100 * MiB, **entry: object) -> ServedModel:
    return ServedModel(ModelEntry(name, size, **entry), EngineSetup(EngineConfig(), LlamaCppConfig()),  # type: ignore[arg-type]
                       ServerConfig(served_model_name=name, max_connections=None, max_connections_per_client=None))


def models_app(models: list[ServedModel], engines: dict[str, Callable[[], Engine]] | None = None,
               front: ServerConfig | None = None, **policy: object) -> FastAPI:
    """The router over fake engines: `engines` replaces a model's (to fail or hold its load)."""
    engines = engines or {}

    def build(_setup: EngineSetup, server: ServerConfig) -> FastAPI:
        name = server.served_model_name
        assert name is not None
        return fake_app(engines.get(name, fake_engine()), name, max_connections=None, max_connections_per_client=None)

    policy_ = ModelPolicy(**{"memory_bytes": 1024 * MiB, "min_resident_s": 0.0, **policy})  # type: ignore[arg-type]
    return create_models_app(ModelsConfig(front or ServerConfig(), tuple(models), policy_), build)


@pytest.fixture
def two() -> Iterator[TestClient]:
    with TestClient(models_app([served("a"), served("b")])) as client:
        yield client


def chat(client: TestClient, model: str | None, **extra: object) -> tuple[int, dict]:
    body: dict = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    if model is not None:
        body["model"] = model
    response = client.post("/v1/chat/completions", json=body)
    return response.status_code, response.json()


def states(client: TestClient) -> dict[str, str]:
    return {card["id"]: card["status"]["value"] for card in client.get("/models").json()["data"]}


def test_each_model_is_loaded_on_demand_and_answers_under_its_name(two: TestClient) -> None:
    assert states(two) == {"a": "unloaded", "b": "unloaded"}
    status, reply = chat(two, "a")
    assert status == 200 and reply["model"] == "a"
    assert states(two) == {"a": "loaded", "b": "unloaded"}
    status, reply = chat(two, "b")
    assert status == 200 and reply["model"] == "b"
    assert [card["id"] for card in two.get("/v1/models").json()["data"]] == ["a", "b"]


def test_an_undeclared_model_is_openais_404_and_a_missing_one_a_400(two: TestClient) -> None:
    status, reply = chat(two, "c")
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    status, reply = chat(two, None)
    assert status == 400 and reply["error"]["param"] == "model"
    assert two.get("/v1/models/c").status_code == 404
    assert states(two) == {"a": "unloaded", "b": "unloaded"}  # nothing was loaded for them


def test_a_model_left_out_is_the_only_one_declared() -> None:
    with TestClient(models_app([served("a")])) as client:
        status, reply = chat(client, None)
        assert status == 200 and reply["model"] == "a"


def test_bad_bodies_are_400s_before_any_load(two: TestClient) -> None:
    assert two.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
                    ).status_code == 400
    assert two.post("/v1/chat/completions", json=[1, 2]).status_code == 400
    assert two.post("/v1/chat/completions", json={"model": 7}).status_code == 400
    deep = b'{"model": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert two.post("/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
                    ).status_code == 400
    status, reply = chat(two, "a", keep_alive="soon")
    assert status == 400 and reply["error"]["param"] == "keep_alive"
    assert states(two) == {"a": "unloaded", "b": "unloaded"}


def test_a_model_that_does_not_fit_beside_another_evicts_it() -> None:
    with TestClient(models_app([served("a", 600 * MiB), served("b", 600 * MiB)])) as client:
        assert chat(client, "a")[0] == 200
        assert chat(client, "b")[0] == 200
        assert states(client) == {"a": "unloaded", "b": "loaded"}
        listing = client.get("/models").json()
        assert listing["memory"]["resident_bytes"] <= listing["memory"]["budget_bytes"] == 1024 * MiB
        metrics = client.get("/metrics").text
        assert 'cobali:model_evictions_total{model="a"} 1.0' in metrics
        assert 'cobali:model_loads_total{model="b"} 1.0' in metrics


def test_a_model_larger_than_the_budget_is_refused_with_a_400_naming_it() -> None:
    with TestClient(models_app([served("big", 2048 * MiB)])) as client:
        status, reply = chat(client, "big")
        assert status == 400 and "--models-memory" in reply["error"]["message"]


def test_a_failed_load_is_that_models_error_alone() -> None:
    def broken() -> Engine:
        raise RuntimeError("/secret/path/model.gguf: bad magic")

    with TestClient(models_app([served("a"), served("broken")], {"broken": broken})) as client:
        status, reply = chat(client, "broken")
        assert status == 503 and "/secret" not in reply["error"]["message"]
        assert chat(client, "a")[0] == 200
        assert states(client)["broken"] == "failed"


def test_a_model_loading_holds_its_requests_and_not_the_others() -> None:
    release = threading.Event()

    def slow() -> Engine:
        assert release.wait(30)
        return fake_engine()()

    with TestClient(models_app([served("a"), served("slow")], {"slow": slow})) as client:
        waiting: list[int] = []
        thread = threading.Thread(target=lambda: waiting.append(chat(client, "slow")[0]))
        thread.start()
        deadline = time.monotonic() + 10
        while states(client)["slow"] != "loading":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert chat(client, "a")[0] == 200  # served while the other loads
        release.set()
        thread.join(30)
        assert waiting == [200]


def test_streams_metrics_and_slots_go_through_the_router(two: TestClient) -> None:
    with two.stream("POST", "/v1/chat/completions", json={"model": "b", "stream": True, "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "hi"}]}) as reply:
        text = "".join(reply.iter_text())
    assert reply.status_code == 200 and text.endswith("data: [DONE]\n\n")
    assert 'cobali:generation_tokens_total{model="b"}' in two.get("/metrics").text
    assert {row["model"] for row in two.get("/slots").json()} == {"b"}


def test_models_load_and_unload_on_request(two: TestClient) -> None:
    assert two.post("/models/load", json={"model": "b"}).json() == {"success": True}
    assert states(two)["b"] == "loaded"
    assert two.post("/models/unload", json={"model": "b"}).json() == {"success": True}
    assert states(two)["b"] == "unloaded"
    assert two.post("/models/load", json={"model": "zz"}).status_code == 404


def test_with_keys_nothing_but_health_and_metrics_is_open() -> None:
    app = models_app([served("a")], front=ServerConfig(api_keys=("k",)))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for path in ("/models", "/v1/models", "/slots"):
            assert client.get(path).status_code == 401, path
        assert client.post("/models/load", json={"model": "a"}).status_code == 401
        assert chat(client, "a")[0] == 401
        assert client.get("/models", headers={"Authorization": "Bearer k"}).json()["data"][0]["status"] == {
            "value": "unloaded"}
