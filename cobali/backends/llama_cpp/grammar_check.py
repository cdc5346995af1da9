"""llama.cpp's own reading of a GBNF grammar, without a context: whether it lets a model write a given text.

The grammar sampler is walked over the text's tokens exactly as generation walks it (each token first allowed
by `apply`, then `accept`ed), and at the end an end-of-generation token must be allowed. Only the vocabulary is
loaded, so this costs milliseconds and no model numerics: the tests use it as the oracle for the grammars the
server builds from regular expressions and JSON schemas.
"""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np

from cobali.backends.llama_cpp.sampler import Candidates
from cobali.backends.llama_cpp.tools import silence_logs


class GrammarCheck:
    def __init__(self, model_path: str) -> None:
        silence_logs()
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.vocab_only = True
        self.model = ll.llama_model_load_from_file(model_path.encode(), params)
        if not self.model:
            raise ValueError(f"could not load a GGUF vocabulary from {model_path}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.end = ll.llama_vocab_eos(self.vocab)
        self._candidates = Candidates(ll.llama_vocab_n_tokens(self.vocab))  # the sampler's own checks

    def compiles(self, grammar: str) -> bool:
        sampler = ll.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if sampler:
            ll.llama_sampler_free(sampler)
        return bool(sampler)

    def allows(self, grammar: str, text: str) -> bool:
        """True when the grammar lets a model write exactly `text` and then stop. ValueError for a text the
        vocabulary cannot write at all (some vocabularies have no token for some bytes)."""
        if not self.can_write(text):
            raise ValueError(f"the vocabulary cannot write {text!r}")
        sampler = ll.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            raise ValueError("llama.cpp cannot parse the grammar")
        try:
            for token in self.tokenize(text):
                if not self._candidates.allows(sampler, token):
                    return False
                ll.llama_sampler_accept(sampler, token)
            return self._candidates.allows(sampler, self.end)
        finally:
            ll.llama_sampler_free(sampler)

    def first_tokens(self, grammar: str) -> set[int]:
        """The tokens the grammar allows first: the whole vocabulary through it once, as the sampler's fallback."""
        sampler = ll.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not sampler:
            raise ValueError("llama.cpp cannot parse the grammar")
        data = self._candidates.data
        try:
            self._candidates.refill(np.zeros(len(data), dtype=np.float32))
            self._candidates.narrow(sampler)
        finally:
            ll.llama_sampler_free(sampler)
        return set(data["id"][np.isfinite(data["logit"])].tolist())

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, False)
        assert n >= 0, "a text never has more tokens than bytes"
        return list(buf[:n])

    def can_write(self, text: str) -> bool:
        return b"".join(self._piece(t) for t in self.tokenize(text)) == text.encode()

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True)
        assert 0 <= n <= len(buf), "a piece longer than 256 bytes"
        return buf.raw[:n]

    def close(self) -> None:
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None
