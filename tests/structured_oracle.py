"""Which texts a constraint allows, asked of llguidance itself: a fresh matcher walked over a text's tokens.

The oracle for the structured-output tests (tests/unit/structured/test_structured_constraints.py,
test_grammar_fuzz.py and their integration twins): a grammar allows a text when the matcher consumes every one of
the text's tokens and is then in an accepting state, so the text may end there. llguidance reads text as bytes, so
any tokenization of a text gives the same answer; BYTES_VOCABULARY (one token a byte, and an end token) can write
every text, where the fake backend's vocabulary (printable ASCII, one character a token) cannot write a newline or a
non-ASCII letter."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

from cobali.backends.fake import FakeBackend
from cobali.structured.compiler import GrammarCompiler

BYTES_EOS = 256


class _Bytes:
    """llguidance's TokenizerWrapper reads this: token b < 256 is the byte b, 256 the end token."""

    eos_token_id, bos_token_id, special_token_ids = BYTES_EOS, None, [BYTES_EOS]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def bytes_tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_Bytes()), slices=[])


class Oracle:
    """A compiler and how a text becomes tokens of its vocabulary (None: this vocabulary cannot write it)."""

    def __init__(self, compiler: GrammarCompiler, tokens_of: Callable[[str], list[int] | None]) -> None:
        self.compiler = compiler
        self.tokens_of = tokens_of
        self._firsts: list[int] | None = None
        self._matchers: dict[str, LLMatcher] = {}

    def compiles(self, grammar: str) -> bool:
        try:
            self.compiler.check(grammar)
        except ValueError:
            return False
        return True

    def can_write(self, text: str) -> bool:
        return self.tokens_of(text) is not None

    def allows(self, grammar: str, text: str) -> bool:
        """Whether the grammar allows exactly `text` as a whole output (it must compile: else ValueError). One
        matcher a grammar, reset after each text: try_consume_tokens stops at a refused token without leaving the
        matcher in its error state."""
        tokens = self.tokens_of(text)
        assert tokens is not None, f"this vocabulary cannot write {text!r}"
        matcher = self._matchers.get(grammar)
        if matcher is None:
            matcher = self._matchers[grammar] = self.compiler.matcher(grammar)
        try:
            return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()
        finally:
            assert not matcher.is_error(), matcher.get_error()
            matcher.reset()

    def allowed_tokens(self, matcher: LLMatcher) -> np.ndarray:
        """The token ids the matcher allows next (its mask); empty when it is in an error state."""
        n_vocab = self.compiler.tokenizer.vocab_size
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        if matcher.is_error():
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(np.unpackbits(mask, bitorder="little", count=n_vocab))

    def first_tokens(self, grammar: str) -> set[int]:
        return set(self.allowed_tokens(self.compiler.matcher(grammar)).tolist())

    def walk(self, grammar: str, rng: np.random.Generator, max_steps: int = 400, end_odds: float = 0.5,
             closers: bytes = b'"]}') -> bytes | None:
        """A random output the grammar allows, or None when it has not ended within max_steps. Each step draws a
        token uniformly from those allowed; the end token, once allowed, is taken with `end_odds`, and a token
        that starts with one of `closers` (ending a JSON string, array or object), when one is allowed, a third
        of the time, so that walks end in a few dozen steps rather than write long strings."""
        tokenizer = self.compiler.tokenizer
        eos = set(tokenizer.eos_tokens)
        firsts = self._first_bytes()
        matcher = self.compiler.matcher(grammar)
        tokens: list[int] = []
        for _ in range(max_steps):
            allowed = self.allowed_tokens(matcher).tolist()
            assert allowed, f"the grammar allows no token after {tokenizer.decode_bytes(tokens)!r}"
            others = [t for t in allowed if t not in eos]
            if len(others) < len(allowed) and (not others or rng.random() < end_odds):
                return tokenizer.decode_bytes(tokens)
            closing = [t for t in others if firsts[t] in closers]
            token = int(rng.choice(closing if closing and rng.random() < 1 / 3 else others))
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        return None

    def _first_bytes(self) -> list[int]:
        if self._firsts is None:
            tokenizer = self.compiler.tokenizer
            self._firsts = [(tokenizer.decode_bytes([t]) or b"\0")[0] for t in range(tokenizer.vocab_size)]
        return self._firsts


def bytes_oracle(tokenizer: LLTokenizer | None = None) -> Oracle:
    """tokenizer: one bytes_tokenizer() made before, for a fresh compiler (nothing compiled) at no cost."""
    return Oracle(GrammarCompiler(bytes_tokenizer if tokenizer is None else lambda: tokenizer),
                  lambda text: list(text.encode()))


def fake_oracle(backend: FakeBackend | None = None) -> Oracle:
    """The fake backend's vocabulary: token t >= 1 is chr(31 + t), so only printable ASCII can be written."""
    backend = backend or FakeBackend()

    def tokens_of(text: str) -> list[int] | None:
        if not all(32 <= ord(c) < 31 + backend.n_vocab for c in text):
            return None
        return [ord(c) - 31 for c in text]

    return Oracle(GrammarCompiler(backend.guidance_tokenizer), tokens_of)


class Hang(BaseException):  # not an Exception: code under test that catches those must not swallow it
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise Hang in the main thread once `seconds` have passed (SIGALRM: a Python loop or a call that releases
    the GIL and returns is interrupted; llguidance's compile drops the GIL, so a slow one is caught on return)."""
    def alarm(_signum: int, _frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_REAL: dict[str, tuple[Any, Oracle]] = {}


def real_oracle(model_path: str) -> Oracle:
    """The embedded model's vocabulary. Its backend stays loaded for the process, shared by every test that asks
    (llguidance's tokenizer calls into the model's vocabulary); one sequence, no KV to speak of."""
    if model_path not in _REAL:
        from cobali.backends.llama_cpp import LlamaCppBackend
        from cobali.backends.llama_cpp.config import LlamaCppConfig

        backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1, n_batch=64))
        tokenizer = backend.guidance_tokenizer()

        def tokens_of(text: str) -> list[int] | None:
            """The model's tokens for the text; None where they write something else (a byte it has no token for:
            llama.cpp's tokenizer drops it)."""
            tokens = tokenizer.tokenize_bytes(text.encode())
            return tokens if tokenizer.decode_bytes(tokens) == text.encode() else None

        oracle = Oracle(GrammarCompiler(lambda: tokenizer), tokens_of)
        _REAL[model_path] = (backend, oracle)
    return _REAL[model_path][1]
