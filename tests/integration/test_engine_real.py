"""The engine on the real embedded model: continuous batching must not change greedy outputs."""

from __future__ import annotations

import pytest

from cobali.backends.base import SamplingParams
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.engine.engine import Engine, EngineConfig
from cobali.engine.request import FinishReason

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that moves across it at night.",
    "def fibonacci(n):",
    "List three uses of a paperclip. First,",
    "Explain in one sentence why the sky is blue. The sky looks blue because",
    "Translate to French: Good morning, how are you today?",
    "Once upon a time in a small village at the edge of a great forest, there lived an old woodcutter who",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def backend(model_path: str):
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=256))
    yield backend
    backend.close()


def run(backend, mode: str, **kw) -> list:
    config = EngineConfig(mode=mode, max_slots=4, n_batch=256, **kw)
    return Engine(backend, config).generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))


@pytest.fixture(scope="module")
def seq_outputs(backend) -> list:
    return run(backend, "seq")


# Chunk 64 is the setting (no prompt here is longer); chunk 8 splits every prompt mid-way.
@pytest.mark.parametrize("chunk", [64, 8])
def test_cont_equals_seq_token_for_token(backend, seq_outputs, chunk: int) -> None:
    seq = seq_outputs
    cont = run(backend, "cont", prefill_chunk_tokens=chunk)
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.output_tokens) == 16 for r in seq + cont)
    for a, b in zip(seq, cont, strict=True):
        assert a.output_tokens == b.output_tokens, (a.text, b.text)
    assert "Paris" in seq[0].text


def test_sampling_chain_with_seed_is_reproducible(backend) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05,
                            repetition_penalty=1.1, seed=3, ignore_eos=True)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    a, b = engine.generate([PROMPTS[1], PROMPTS[1]], params)
    assert a.output_tokens == b.output_tokens and len(a.output_tokens) == 12


def test_chat_template_and_stop_string(backend) -> None:
    prompt = backend.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer briefly."}])
    assert prompt.startswith("<|im_start|>")
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    (r,) = engine.generate([prompt], SamplingParams(max_tokens=40, stop=("4",)))
    assert r.finish_reason is FinishReason.STOP and "4" not in r.text
