"""The OpenAI features that need llama.cpp itself (prompt logits, its sampler chain, its templates), through
the official `openai` client against `cobali serve` on the embedded model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from cobali.backends.llama_cpp import LlamaCppBackend, LlamaCppOptions
from tests.integration.test_server_openai import PROMPT, running_server


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with running_server("--max-slots", "4", "--served-model-name", "smol") as (base, _proc):
        yield OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_echo_scores_the_prompt_like_generation_does(client: OpenAI) -> None:
    """The logprob the prompt's last token gets under echo is the one generation gives it from the prefix."""
    greedy = client.completions.create(model="smol", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True}).choices[0]
    scored = client.completions.create(model="smol", prompt=PROMPT + greedy.text, max_tokens=1, temperature=0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text.startswith(PROMPT + greedy.text)
    assert lp.token_logprobs[0] is None and len(lp.tokens) == scored.usage.prompt_tokens + 1
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    last_prompt_token = scored.usage.prompt_tokens - 1
    assert lp.tokens[last_prompt_token] == greedy.text
    # Different batch shapes: equal up to llama.cpp's numerics, not bit for bit.
    assert lp.token_logprobs[last_prompt_token] == pytest.approx(greedy.logprobs.token_logprobs[0], abs=0.05)


def test_logit_bias_reaches_llama_cpp_sampling(client: OpenAI, model_path: str) -> None:
    backend = LlamaCppBackend(LlamaCppOptions(model_path, n_ctx=64, n_seq_max=1, n_threads=1))
    try:
        [token] = backend.tokenize("Hello", add_special=False)
    finally:
        backend.close()
    # Sampled through llama.cpp's chain (temperature > 0), not the greedy shortcut.
    text = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, temperature=0.7, seed=1,
                                     logit_bias={str(token): 100}, extra_body={"ignore_eos": True}).choices[0].text
    assert text == "HelloHelloHello"
