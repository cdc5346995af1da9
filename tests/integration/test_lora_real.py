"""LoRA adapters on the real model (a random adapter from `cobali synth-lora`): an adapter's requests and the
base model's, served together, each get what they get alone, up to near-ties (cobali.harness.fidelity)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from openai import OpenAI

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.synth_lora import write_random_lora
from cobali.frontend.offline import LLM
from cobali.harness.fidelity import TOP_LOGPROBS, Trace, compare_runs
from tests.integration.test_server_openai import running_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time in a small village",
           "List three uses of a paperclip. First,"]


@pytest.fixture(scope="module")
def adapter(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("lora") / "random.gguf"
    write_random_lora(model_path, str(path), rank=8, alpha=8.0, scale=0.2)
    return str(path)


@pytest.fixture(scope="module")
def backend(model_path: str, adapter: str) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=256, lora_paths=(adapter,)))
    yield backend
    backend.close()


def traces(backend: LlamaCppBackend, mode: str, jobs: list[tuple[str, int]]) -> list[Trace]:
    engine = Engine(backend, EngineConfig(mode=mode, max_slots=4, n_batch=256))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=TOP_LOGPROBS)
    requests = [engine.add_request(prompt, params, lora=lora) for prompt, lora in jobs]
    list(LLM(engine).run())
    return [Trace(tuple(r.output_tokens), tuple(lp.top[0][1] - lp.top[1][1] for lp in r.logprobs)) for r in requests]


def test_adapter_and_base_requests_served_together_match_each_alone(backend: LlamaCppBackend) -> None:
    jobs = [(p, lora) for p in PROMPTS for lora in (0, 1)]  # each prompt with and without the adapter
    alone = traces(backend, "seq", jobs)
    assert sum(a.tokens != b.tokens for a, b in zip(alone[::2], alone[1::2], strict=True)) >= 2  # it matters
    report = compare_runs(alone, traces(backend, "cont", jobs))
    assert report.passed and report.mostly_common, report.describe()


def texts(client: OpenAI, model: str) -> list[str]:
    """Greedy texts of PROMPTS, in order."""
    reply = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]


def test_serve_routes_the_model_name_to_its_adapter(adapter: str) -> None:
    with running_server("--max-slots", "2", "--served-model-name", "smol", "--lora-modules",
                        f"random={adapter}") as (base, _proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"smol", "random"} and models["random"].model_extra["parent"] == "smol"
        # Routed to the adapter: its text differs for some prompt (a random adapter moves the logits by nats,
        # far beyond one CPU's numerics against another's).
        assert any(a != b for a, b in zip(texts(client, "smol"), texts(client, "random"), strict=True))
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "model": "nope"}).status_code == 404


def test_an_adapter_loaded_and_unloaded_while_serving(adapter: str) -> None:
    with running_server("--max-slots", "2", "--served-model-name", "smol", "--allow-runtime-lora-updating") as (
            base, _proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)

        for round_ in range(2):  # the second load gets a new index: nothing of the first is reused wrongly
            loaded = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": adapter})
            assert loaded.status_code == 200, loaded.text
            assert {m.id for m in client.models.list().data} == {"smol", "late"}
            assert any(a != b for a, b in zip(texts(client, "smol"), texts(client, "late"), strict=True)), round_
            tuned = texts(client, "late")  # the adapter is the one set on the context when it is unloaded
            assert httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
            assert httpx.post(f"{base}/v1/completions", json={"prompt": "x", "model": "late"}).status_code == 404
            assert len(texts(client, "smol")) == len(tuned)  # the base model still serves, the freed adapter unset
        bad = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": __file__})
        assert bad.status_code == 400 and "is not a LoRA adapter this server can load" in bad.text
        missing = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/a.gguf"})
        # Not vLLM's 404: the answer must not tell which paths exist on the server's disk.
        assert missing.status_code == 400 and missing.json()["error"]["message"] == bad.json()["error"][
            "message"].replace(__file__, "/no/a.gguf")


def test_an_adapter_unloaded_while_set_leaves_the_base_model(model_path: str, adapter: str) -> None:
    """The backend unsets an adapter it frees: the next decode is the base model's, whoever calls it."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=2, n_batch=64))
    try:
        tokens = np.array(backend.tokenize(PROMPTS[0]), dtype=np.int32)

        def logits(seq: int) -> np.ndarray:
            n = len(tokens)
            out = backend.decode(tokens, np.arange(n, dtype=np.int32), np.full(n, seq, dtype=np.int32),
                                 np.arange(n) == n - 1)
            backend.remove_seq(seq)
            return out[0].copy()

        base = logits(0)
        with pytest.raises(ValueError, match="could not load a LoRA adapter"):
            backend.load_lora(__file__)
        index = backend.load_lora(adapter)
        assert index == 1  # the failed load used up no index
        backend.use_lora(index)
        assert not np.allclose(logits(1), base, atol=1e-3)
        backend.unload_lora(index)
        assert np.allclose(logits(0), base, atol=1e-4)  # one backend, one batch shape: the same numbers
    finally:
        backend.close()
