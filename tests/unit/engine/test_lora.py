"""LoRA adapters on the fake backend, where adapter i moves every greedy token: requests of different adapters
share the engine but never a batch (llama.cpp applies adapters to a whole decode) nor a cached prefix."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.cli import main
from cobali.frontend.offline import LLM
from tests.unit.http.test_server_api import fake_app, wait_healthy

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
PROMPT = "the cat sat on the mat and looked at the dog"  # longer than the prefix cache's shortest reuse


def engine(slots: int = 4, **config) -> Engine:
    return Engine(FakeBackend(n_seq_max=slots, n_loras=2), EngineConfig(max_slots=slots, **config))


def alone(prompt: str, lora: int) -> list[int]:
    e = engine(1)
    request = e.add_request(prompt, PARAMS, lora=lora)
    list(LLM(e).run())
    return request.output_tokens


def test_each_request_gets_its_own_adapters_outputs_in_a_mixed_load() -> None:
    e = engine()
    prompts = [f"{PROMPT} {i}" for i in range(9)]
    requests = [e.add_request(p, PARAMS, lora=i % 3) for i, p in enumerate(prompts)]
    list(LLM(e).run())
    assert len({tuple(alone(prompts[0], lora)) for lora in (0, 1, 2)}) == 3  # the adapters matter
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.output_tokens == alone(prompt, request.lora), request.lora
    by_id = {r.id: r for r in requests}
    for tick in e.ticks:
        assert {by_id[c.request_id].lora for c in tick.plan.chunks} == {tick.plan.lora}
    assert {t.plan.lora for t in e.ticks} == {0, 1, 2}


def test_a_prefix_computed_under_an_adapter_is_reused_by_that_adapter_alone() -> None:
    e = engine()

    def run(lora: int) -> Request:
        request = e.add_request(PROMPT, PARAMS, lora=lora)
        list(LLM(e).run())
        assert request.output_tokens == alone(PROMPT, lora), lora
        return request

    assert run(1).cached_tokens == 0
    assert run(0).cached_tokens == 0  # the adapter's KV of this prompt is not the base model's
    assert run(2).cached_tokens == 0  # nor another adapter's
    assert run(1).cached_tokens > 0  # its own adapter's, kept in a slot
    assert run(0).cached_tokens > 0 and run(2).cached_tokens > 0


def test_running_requests_are_copied_from_by_their_own_adapter_only() -> None:
    e = engine()
    long = SamplingParams(max_tokens=40, ignore_eos=True)
    adapter = e.add_request(PROMPT, long, lora=2)
    e.step()
    e.step()  # the adapter's request is decoding when two more, sharing its prompt, arrive
    base = e.add_request(PROMPT, PARAMS)
    same = e.add_request(PROMPT, PARAMS, lora=2)
    list(LLM(e).run())
    assert base.cached_tokens == 0 and base.output_tokens == alone(PROMPT, 0)
    assert same.cached_tokens > 0 and same.output_tokens == alone(PROMPT, 2)
    assert adapter.output_tokens[:12] == alone(PROMPT, 2)


def test_adapter_keys_never_meet_real_tokens() -> None:
    request = Request(0, [0, 5, (1 << 18) - 1], PARAMS, lora=8191)
    keys = request.kv_key(3)
    assert all(-(2**31) <= k < 0 for k in keys) and len(set(keys)) == 3
    assert Request(0, [0, 5], PARAMS).kv_key(2) == [0, 5]


def test_adapters_take_turns_and_all_finish() -> None:
    e = engine(slots=2)
    requests = [e.add_request(f"{PROMPT} {i}", SamplingParams(max_tokens=20, ignore_eos=True), lora=i % 2)
                for i in range(6)]
    list(LLM(e).run())
    assert all(len(r.output_tokens) == 20 for r in requests)
    loras = [t.plan.lora for t in e.ticks]
    switches = sum(a != b for a, b in itertools.pairwise(loras))
    assert switches > len(loras) // 3  # busy adapters alternate, rather than one running to the end


def test_bad_adapters_are_refused() -> None:
    e = engine()
    with pytest.raises(ValueError, match="LoRA adapter 3 is not loaded"):
        e.add_request("x", PARAMS, lora=3)
    with pytest.raises(ValueError, match="async scheduling"):
        engine(async_scheduling=True)


def test_only_the_base_model_without_adapters() -> None:
    e = Engine(FakeBackend(n_seq_max=2), EngineConfig(max_slots=2))
    with pytest.raises(ValueError, match=r"LoRA adapter 1 is not loaded \(loaded: none\)"):
        e.add_request("x", PARAMS, lora=1)
    request: Request = e.add_request("x", PARAMS)
    list(LLM(e).run())
    assert e._scheduler.adapters is None and len(request.output_tokens) == 12


def test_an_engine_sets_the_adapter_whatever_another_left_on_the_backend() -> None:
    backend = FakeBackend(n_seq_max=2, n_loras=2)
    first = Engine(backend, EngineConfig(max_slots=2))
    first.add_request(PROMPT, PARAMS, lora=2)
    list(LLM(first).run())
    second = Engine(backend, EngineConfig(max_slots=2))
    request = second.add_request(PROMPT, PARAMS)
    list(LLM(second).run())
    assert request.output_tokens == alone(PROMPT, 0)


@pytest.fixture(scope="module")
def api() -> Iterator[TestClient]:
    factory = lambda: Engine(FakeBackend(n_seq_max=4, n_loras=2), EngineConfig(max_slots=4))  # noqa: E731
    adapters = (("first", "first.gguf"), ("second", "second.gguf"))  # loaded with the model (n_loras)
    with TestClient(fake_app(factory, "base", lora_modules=adapters)) as client:
        wait_healthy(client)
        yield client


def test_the_server_lists_its_adapters_and_routes_the_model_to_them(api: TestClient) -> None:
    cards = api.get("/v1/models").json()["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [("base", None), ("first", "base"), ("second", "base")]
    assert api.get("/v1/models/second").json()["parent"] == "base"
    assert api.get("/v1/models/third").status_code == 404
    fake = FakeBackend()
    for model, lora in (("base", 0), (None, 0), ("first", 1), ("second", 2)):
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = api.post("/v1/completions", json={**body, **({"model": model} if model else {})}).json()
        assert reply["choices"][0]["text"] == "".join(fake.token_bytes(t).decode() for t in alone(PROMPT, lora))
        assert reply["model"] == (model or "base")
    chat = api.post("/v1/chat/completions", json={"model": "second", "messages": [{"role": "user", "content": "x"}],
                                                  "max_tokens": 2})
    responses = api.post("/v1/responses", json={"model": "first", "input": "x", "max_output_tokens": 2})
    assert chat.json()["model"] == "second" and responses.json()["model"] == "first"
    assert api.post("/v1/completions", json={"model": "third", "prompt": "x"}).status_code == 404


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "nameonly"], "expected NAME=PATH, got 'nameonly'"),
    (["--lora-modules", "a=/nonexistent.gguf"], "a: no such adapter file '/nonexistent.gguf'"),
    (["--lora-modules", "a=README.md", "a=README.md"], "must differ"),
    (["--lora-modules", "smol=README.md", "--served-model-name", "smol"], "must differ"),
])
def test_serve_names_bad_adapter_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
