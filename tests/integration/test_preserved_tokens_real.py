"""Preserved tokens on the embedded model: SmolLM2's `<|im_start|>` is a control token, rendered as no text, and
kept as its text where a request preserves it; the frontend's Tokenizer finds it from its tag."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

TAG = "<|im_start|>"


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[Engine]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1, n_batch=64))
    yield Engine(backend, EngineConfig(max_slots=1, n_batch=64))
    backend.close()


def test_a_preserved_control_token_keeps_its_text(engine: Engine) -> None:
    control = engine.tokenizer.control_token(TAG)
    assert control is not None and engine.tokenizer.control_token("Hello") is None
    assert engine._backend.token_bytes(control) == b"" and engine._backend.special_token_bytes(control) == TAG.encode()
    forced = SamplingParams(max_tokens=2, logit_bias=((control, 100.0),))
    plain = LLM(engine).generate(["Hi"], forced)[0]
    kept = LLM(engine).generate(["Hi"], dataclasses.replace(forced, preserved_tokens=frozenset({control})))[0]
    assert list(plain.token_ids) == list(kept.token_ids) == [control] * 2
    assert TAG not in plain.text and kept.text == TAG * 2
