"""Prompt-token logprobs in the engine: every position once, whatever splits the prompt (chunks, a
preemption that recomputes it) and whatever shares the batch."""

from __future__ import annotations

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from tests.unit.http.test_openai_conformance import fake_logprob

PROMPTS = [list(range(1, 41)), list(range(5, 33))]


def expected(prompt: list[int]) -> list[float]:
    return [fake_logprob(prompt[:i], prompt[i]) for i in range(1, len(prompt))]


@pytest.mark.parametrize(("chunk", "fail_on_calls"), [(64, set()), (7, set()), (7, {3})])
def test_each_prompt_position_is_scored_once(chunk: int, fail_on_calls: set[int]) -> None:
    backend = FakeBackend(n_seq_max=2, n_ctx_seq=128, n_batch=64, fail_on_calls=fail_on_calls, fail_code=1)
    engine = Engine(backend, EngineConfig(max_slots=2, prefill_chunk_tokens=chunk, n_batch=64))
    scored = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2, logprobs=0)
    plain = LLM(Engine(FakeBackend(n_seq_max=2, n_ctx_seq=128), EngineConfig(max_slots=2))).generate(
        PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True))
    runs = LLM(engine).generate(PROMPTS, scored)
    assert engine._scheduler.preemptions == len(fail_on_calls)
    for run, clean, prompt in zip(runs, plain, PROMPTS, strict=True):
        assert [e.token for e in run.prompt_logprobs] == prompt[1:]
        assert [e.logprob for e in run.prompt_logprobs] == pytest.approx(expected(prompt), abs=1e-5)
        assert all(len(e.top) == 2 for e in run.prompt_logprobs)
        assert run.token_ids == clean.token_ids  # the extra logits rows change no sample
