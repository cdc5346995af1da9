"""A llama.cpp model's text side: its tokens, their bytes, its chat template, and its vocabulary as llguidance
reads it. LlamaCppVocabulary.load reads the vocabulary alone, without the weights (a sixth of the memory, for the
embedded model): a frontend's process tokenizes with it, apart from the engine's. LlamaCppBackend is one over the
model it loads whole.

Tokenizing long texts in linear time: llama.cpp first splits a text at every special token it holds
(parse_special), then tokenizes the pieces apart; its splitting costs time quadratic in the text once it holds many
special tokens (a long chat: minutes, in docs/results.md, "Hardening"). The pieces are independent, so a long text
is cut right after special tokens into chunks of a few kB, each tokenized alone: the same tokens, in linear time.
"""

from __future__ import annotations

import ctypes
import re
import warnings

import llama_cpp as ll
import numpy as np
from llguidance import LLTokenizer
from llguidance.llamacpp import lltokenizer_from_vocab

from cobali.backends.base import TemplateSource, Vocabulary
from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.loading import load_model

CHUNK_CHARS = 8192  # a chunk holds at least this much text (unless the text ends first)
_SPECIAL = ll.LLAMA_TOKEN_ATTR_CONTROL | ll.LLAMA_TOKEN_ATTR_USER_DEFINED


class LlamaCppVocabulary(Vocabulary):
    """The Vocabulary of one llama.cpp model, which it owns and frees on close(). Thread-safe: it only reads the
    vocabulary (its caches are dicts a token's bytes are put in whole). It declares the protocol, so that mypy
    checks it (and LlamaCppBackend) against it."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab = ll.llama_model_get_vocab(model)
        self.tokenizer = Tokenizer(self.vocab)
        self._pieces: dict[int, bytes] = {}
        self._special_pieces: dict[int, bytes] = {}

    @classmethod
    def load(cls, options: LlamaCppConfig) -> LlamaCppVocabulary:
        """The vocabulary of options.model_path (None: the embedded model) read vocabulary-only: its tokenizer
        and metadata (the chat template among them); no tensor is read or allocated. ValueError saying why the
        file cannot be read."""
        ll.llama_backend_init()
        return cls(load_model(options.model_path or embedded_model_path(), options, vocab_only=True))

    @property
    def n_vocab(self) -> int:
        return ll.llama_vocab_n_tokens(self.vocab)

    @property
    def max_token_bytes(self) -> int:
        return self.tokenizer.longest_piece

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, add_special)

    def token_bytes(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self.vocab, token, False)
        return piece

    def special_token_bytes(self, token: int) -> bytes:
        piece = self._special_pieces.get(token)
        if piece is None:
            piece = self._special_pieces[token] = token_piece(self.vocab, token, True)
        return piece

    def eog_mask(self) -> np.ndarray:
        return np.array([ll.llama_vocab_is_eog(self.vocab, t) for t in range(self.n_vocab)], dtype=bool)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        template = ll.llama_model_chat_template(self.model, None)
        if not template:
            raise ValueError("the model has no chat template")
        chat = (ll.llama_chat_message * len(messages))()
        keep = []  # the C structs point into these bytes
        for item, message in zip(chat, messages, strict=True):
            role, content = message["role"].encode(), message["content"].encode()
            keep += [role, content]
            item.role, item.content = role, content
        size = 1024 + 2 * sum(len(b) for b in keep)
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(template, chat, len(messages), True, buf, size)
        if n < 0:
            raise ValueError("the model's chat template is not supported by llama.cpp")
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = ll.llama_chat_apply_template(template, chat, len(messages), True, buf, n)
        return buf.raw[:n].decode("utf-8", errors="replace")

    def chat_template_source(self) -> TemplateSource:
        text = ll.llama_model_chat_template(self.model, None)
        return TemplateSource(text.decode("utf-8", errors="replace") if text else None,
                              self._special_text(ll.llama_vocab_bos(self.vocab)),
                              self._special_text(ll.llama_vocab_eos(self.vocab)),
                              bool(ll.llama_vocab_get_add_bos(self.vocab)))

    def _special_text(self, token: int) -> str:
        if token < 0:  # LLAMA_TOKEN_NULL: the model has no such token
            return ""
        return self.special_token_bytes(token).decode("utf-8", errors="replace")

    def guidance_tokenizer(self) -> LLTokenizer:
        """Every end-of-generation token ends a constrained output, as it ends any other. The tokenizer calls
        into this vocabulary: it must not be used after close()."""
        with warnings.catch_warnings():  # it calls a deprecated binding once per token: tens of thousands of warnings
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self.vocab, n_vocab=self.n_vocab,
                                          eos_token=np.flatnonzero(self.eog_mask()).tolist())

    def close(self) -> None:
        if self.model:
            ll.llama_model_free(self.model)
            self.model = self.vocab = None


class Tokenizer:
    """llama.cpp's tokenizer over one vocabulary, in time linear in the text (the module's docstring)."""

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
        buf = ctypes.create_string_buffer(256)  # one buffer for them all: this runs over the whole vocabulary
        return [token_piece(self.vocab, token, special, buf) for token in tokens]


def token_piece(vocab, token: int, special: bool, buf: ctypes.Array[ctypes.c_char] | None = None) -> bytes:
    """A token's bytes (special: a control token's text written out, else empty), through `buf` if it is big
    enough (a buffer of the caller's: not shared between threads)."""
    if buf is None:
        buf = ctypes.create_string_buffer(64)
    n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:  # too small: -n is the size needed
        buf = ctypes.create_string_buffer(-n)
        n = ll.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]
