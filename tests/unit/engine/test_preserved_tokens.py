"""SamplingParams.preserved_tokens: a control token, shown as no text, keeps its text in the output where it is
preserved; the output's stop strings and stream see that text like any other. On the fake backend with one
control token, forced by a logit bias."""

from __future__ import annotations

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

CONTROL = 96  # past the fake's printable characters
TAG = "[TOOL_CALLS]"


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def llm(request: pytest.FixtureRequest) -> LLM:
    backend = FakeBackend(n_seq_max=2, n_vocab=97, control_tokens={CONTROL: TAG})
    return LLM(Engine(backend, EngineConfig(max_slots=2, n_batch=64, async_scheduling=request.param)))


def forced(**params) -> SamplingParams:
    """Every token the control token, then ordinary ones (the bias ends after max_tokens)."""
    return SamplingParams(max_tokens=3, logit_bias=((CONTROL, 100.0),), **params)


def test_the_fake_vocabulary_holds_a_control_token() -> None:
    backend = FakeBackend(n_vocab=97, control_tokens={CONTROL: TAG})
    assert backend.tokenize(f"a{TAG}b") == [*backend.tokenize("a"), CONTROL, *backend.tokenize("b")]
    assert backend.token_bytes(CONTROL) == b"" and backend.special_token_bytes(CONTROL) == TAG.encode()
    assert backend.special_token_bytes(backend.tokenize("a")[0]) == b"a"


def test_a_control_token_is_no_text_unless_preserved(llm: LLM) -> None:
    plain = llm.generate(["hi"], forced())[0]
    kept = llm.generate(["hi"], forced(preserved_tokens=frozenset({CONTROL})))[0]
    assert list(plain.token_ids) == list(kept.token_ids) == [CONTROL] * 3
    assert plain.text == "" and kept.text == TAG * 3


def test_streamed_text_and_stop_strings_see_a_preserved_tag(llm: LLM) -> None:
    keep = frozenset({CONTROL})
    assert "".join(llm.stream("hi", forced(preserved_tokens=keep))) == TAG * 3
    stopped = llm.generate(["hi"], forced(preserved_tokens=keep, stop=("CALLS][TOOL",)))[0]
    assert stopped.text == "[TOOL_" and stopped.stop_reason == "CALLS][TOOL"
    # Unpreserved, the tag is not text: no stop string can see it.
    assert llm.generate(["hi"], forced(stop=("CALLS",)))[0].stop_reason is None


@pytest.mark.parametrize("preserved", [frozenset({-1}), {CONTROL}, (CONTROL,)])
def test_preserved_tokens_must_be_a_frozenset_of_token_ids(preserved) -> None:
    with pytest.raises(ValueError, match="preserved_tokens"):
        SamplingParams(preserved_tokens=preserved)
