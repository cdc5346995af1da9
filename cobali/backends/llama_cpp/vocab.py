"""Tokenizing long texts in linear time.

llama.cpp first splits a text at every special token it holds (parse_special), then tokenizes the pieces apart;
its splitting costs time quadratic in the text once it holds many special tokens (a long chat: minutes, in
docs/results.md, "Hardening"). The pieces are independent, so a long text is cut right after special tokens into
chunks of a
few kB, each tokenized alone: the same tokens, in linear time.
"""

from __future__ import annotations

import ctypes
import re

import llama_cpp as ll

CHUNK_CHARS = 8192  # a chunk holds at least this much text (unless the text ends first)
_SPECIAL = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED


class Tokenizer:
    def __init__(self, vocab) -> None:
        self.vocab = vocab
        self._specials: re.Pattern[str] | None = None
        # A text of more characters than the context's tokens times this never fits (each character is a byte
        # at least, each token at most this many).
        self.longest_piece = max(map(len, self._pieces(range(ll.llama_vocab_n_tokens(vocab)), special=False)))
        # With an end token added per call, chunks would each get one.
        self._chunks = not ll.llama_vocab_get_add_eos(vocab)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if len(text) <= 2 * CHUNK_CHARS or not self._chunks:
            return self._tokenize(text, add_special)
        tokens: list[int] = []
        start = 0
        for cut in self._cuts(text):
            tokens += self._tokenize(text[start:cut], add_special and start == 0)
            start = cut
        return tokens + self._tokenize(text[start:], add_special and start == 0)

    def _cuts(self, text: str):
        """Positions right after a special token, at least CHUNK_CHARS apart."""
        specials = self._special_pattern()
        position = CHUNK_CHARS
        while specials is not None and (found := specials.search(text, position)) is not None:
            yield found.end()
            position = found.end() + CHUNK_CHARS

    def _special_pattern(self) -> re.Pattern[str] | None:
        if self._specials is None:
            n = ll.llama_vocab_n_tokens(self.vocab)
            special = [t for t in range(n) if ll.llama_vocab_get_attr(self.vocab, t) & _SPECIAL]
            texts = sorted({p.decode("utf-8", errors="replace") for p in self._pieces(special, special=True)} - {""},
                           key=len, reverse=True)  # the longest first, as llama.cpp matches them
            self._specials = re.compile("|".join(map(re.escape, texts))) if texts else re.compile(r"(?!)")
        return self._specials

    def _tokenize(self, text: str, add_special: bool) -> list[int]:
        data = text.encode("utf-8", errors="replace")
        capacity = len(data) + 16
        buf = (ll.llama_token * capacity)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        if n < 0:  # buffer too small: -n is the size needed
            capacity = -n
            buf = (ll.llama_token * capacity)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, True)
        return list(buf[:n])

    def _pieces(self, tokens, special: bool) -> list[bytes]:
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for token in tokens:
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self.vocab, token, big, len(big), 0, special)
                pieces.append(big.raw[:n])
            else:
                pieces.append(buf.raw[:n])
        return pieces
