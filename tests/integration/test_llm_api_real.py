"""The Python user's first lines, as vLLM's: LLM(model, **options) loads the model, and generate, chat and embed
run on it; the same engine the server runs, as the server renders chats."""

from __future__ import annotations

import numpy as np
import pytest

from cobali import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(model_path: str):
    with LLM(model_path, max_slots=4, n_ctx=1024) as llm:
        yield llm


def test_the_options_size_the_engine_and_its_backend(llm: LLM) -> None:
    assert llm.engine.config.max_slots == 4
    assert llm.engine.backend_info.n_ctx == 1024


def test_generate_and_chat_run_on_the_loaded_model(llm: LLM) -> None:
    [plain] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(plain.token_ids) == 3 and plain.text
    user = [{"role": "user", "content": "Say hi."}]
    one, two = llm.chat([user, [*user, {"role": "assistant", "content": "Hi."}, *user]],
                        SamplingParams(max_tokens=3, ignore_eos=True))
    assert one.stats.n_prompt_tokens < two.stats.n_prompt_tokens  # each conversation rendered whole
    [alone] = llm.chat(user, SamplingParams(max_tokens=3, ignore_eos=True))  # one conversation, not a list
    assert alone.stats.n_prompt_tokens == one.stats.n_prompt_tokens


def test_chat_renders_as_the_server_does(llm: LLM) -> None:
    prompt = llm._chat_prompt([{"role": "user", "content": "Say hi."}], None, None)
    assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n")


def test_embed_gives_a_row_per_input_the_same_for_a_text_and_its_tokens(llm: LLM) -> None:
    rows = llm.embed(["hello world", llm.engine.tokenizer.encode("hello world")])
    assert rows.shape[0] == 2 and np.allclose(rows[0], rows[1], atol=1e-5)
    with pytest.raises(ValueError, match="embeddings take"):
        llm.embed([[]])
