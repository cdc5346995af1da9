"""Long texts on the real vocabulary: tokenized in chunks cut after special tokens (llama.cpp's own split is
quadratic in them), with the very tokens one call gives; and a text that cannot fit the context refused before it
is tokenized."""

from __future__ import annotations

import random

import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.vocab import CHUNK_CHARS
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig

PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "\n", " hello", "world", "é", "  ", "<", "|",
          "im_end", "ab<|im_", "1234", "😀"]


@pytest.fixture(scope="module")
def backend(model_path: str):
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1))
    yield backend
    backend.close()


@pytest.mark.parametrize("seed", range(4))
def test_a_long_text_tokenizes_in_chunks_as_in_one_call(backend: LlamaCppBackend, seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(3 * CHUNK_CHARS // 4, 3 * CHUNK_CHARS)))
    assert len(text) > 2 * CHUNK_CHARS  # long enough to be cut
    assert backend.tokenizer.tokenize(text) == backend.tokenizer._tokenize(text, True)


def test_a_text_that_cannot_fit_the_context_is_refused_untokenized(backend: LlamaCppBackend,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(backend, EngineConfig(max_slots=1))
    limit = engine._slots.accountant.seq_limit
    too_long = "<|im_end|>" * (limit * backend.max_token_bytes // 10 + 1)
    read: list[int] = []
    tokenize = backend.tokenize
    monkeypatch.setattr(backend, "tokenize", lambda text, *a: read.append(len(text)) or tokenize(text, *a))
    with pytest.raises(ValueError, match="the context holds"):
        engine.tokenizer.prompt_tokens(too_long)
    assert read == []  # refused unread: tokenized, a text this long costs seconds
    kept = engine.tokenizer.prompt_tokens(too_long, keep=8)  # truncate_prompt_tokens: only its end is read
    assert len(kept) == 8 and read == [9 * backend.max_token_bytes]
