"""The model's text side, handed to the frontend: tokens, their bytes, and the checks a prompt's tokens pass."""

from __future__ import annotations

from collections.abc import Iterable

from cobali.backends.base import Vocabulary


class Tokenizer:
    """The model's text side: tokens, their bytes, and the model's own chat template matcher, over a Vocabulary
    (the engine's backend, or a vocabulary of the frontend's own). Thread-safe (it only reads the vocabulary), so
    the frontend's workers tokenize while the engine ticks."""

    def __init__(self, vocabulary: Vocabulary, max_model_len: int, context_hint: str) -> None:
        self.n_vocab = vocabulary.n_vocab
        self.max_model_len = max_model_len
        self.context_hint = context_hint
        self._max_token_bytes = vocabulary.max_token_bytes
        self._vocabulary = vocabulary
        self.token_bytes = vocabulary.token_bytes  # bound once: logprobs read it for every token they show

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        return self._vocabulary.tokenize(text, add_special)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The model's own template matcher (no tools): a model without a Jinja template is prompted with it."""
        return self._vocabulary.apply_chat_template(messages)

    def control_token(self, tag: str) -> int | None:
        """The control token whose text `tag` is (one token, shown as no text unless its text is preserved), else
        None: a tag of several tokens, or one shown as text anyway, needs no preserving."""
        tokens = self.encode(tag, add_special=False)
        return tokens[0] if len(tokens) == 1 and not self.token_bytes(tokens[0]) else None

    def decode(self, tokens: Iterable[int]) -> str:
        return b"".join(map(self.token_bytes, tokens)).decode("utf-8", errors="replace")

    def check_ids(self, tokens: Iterable[int], what: str) -> None:
        """ValueError unless every id is in the vocabulary."""
        if any(not 0 <= t < self.n_vocab for t in tokens):
            raise ValueError(f"{what} must be in [0, {self.n_vocab})")

    @property
    def max_prompt_chars(self) -> int:
        """Characters past which a text cannot fit the context, whatever its tokens (0: unknown)."""
        return self.max_model_len * self._max_token_bytes

    def too_long(self, chars: str) -> ValueError:
        """The refusal of a prompt of `chars` characters, too many for the context."""
        return ValueError(f"prompt has over {self.max_model_len} tokens ({chars} characters); the context holds "
                          f"{self.max_model_len} per request ({self.context_hint})")

    def prompt_tokens(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        """A prompt's tokens, refused (ValueError) when it cannot run; keep: only its last `keep` tokens (vLLM's
        truncate_prompt_tokens)."""
        limit = self.max_model_len
        if isinstance(prompt, str):  # one that cannot fit is not tokenized: the cost grows with the text
            most = (keep + 1) * self._max_token_bytes if keep else self.max_prompt_chars
            if keep is None and most and len(prompt) > most:
                raise self.too_long(str(len(prompt)))
            tokens = self.encode(prompt[-most:] if most else prompt)
        else:
            tokens = list(prompt)
        tokens = tokens if keep is None else tokens[-keep:]
        if not tokens:
            raise ValueError("prompt is empty")
        if len(tokens) >= limit:
            raise ValueError(f"prompt has {len(tokens)} tokens; the context holds {limit} per request "
                             f"({self.context_hint})")
        self.check_ids(tokens, "prompt token ids")
        return tokens
