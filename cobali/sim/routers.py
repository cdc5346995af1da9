"""The simulator's routers that read no replica's state, only the load it is handed: power of two choices on
requests in flight (Ray Serve's default router) and the approximate prefix tree (frontend/text_prefix_routing.py).

The tree routes by text: a request's own (a text prompt, or the chat as rendered) where it has one, else a
stand-in written from its tokens (TokenWords: each token id a fixed word of about chars_per_token characters).
Prompts that share leading tokens then share leading text, as a conversation's turns over its customer's context
share their rendered prefix (sim/conversations.py).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from string import ascii_lowercase

from cobali.frontend.prefix_routing import ReplicaLoad
from cobali.frontend.text_prefix_routing import TextPrefixRouter, TextRoutingConfig


@dataclass(frozen=True)
class PowerOfTwo:
    """Ray Serve's default: two replicas drawn at random, the one with fewer requests in flight takes it."""


class TokenWords:
    """A word per token id: its digits in base 26, as letters (at least enough to pad the word to about
    chars_per_token characters), then a space; distinct ids, distinct words."""

    def __init__(self, chars_per_token: float) -> None:
        self.width = max(1, round(chars_per_token) - 1)
        self._words: dict[int, str] = {}

    def word(self, token: int) -> str:
        word = self._words.get(token)
        if word is None:
            assert token >= 0
            letters: list[str] = []
            rest = token
            while rest or len(letters) < self.width:
                rest, digit = divmod(rest, len(ascii_lowercase))
                letters.append(ascii_lowercase[digit])
            word = self._words[token] = "".join(letters) + " "
        return word

    def text(self, tokens: Sequence[int]) -> str:
        return "".join([self.word(token) for token in tokens])


class TwoChoices:
    name = "least-busy"

    def __init__(self, n_replicas: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._replicas = range(n_replicas)
        self.balanced = 0

    def pick(self, queues: Sequence[tuple[int, int]], text: str | None, tokens: Sequence[int],
             session: str | None) -> int:
        drawn = self._rng.sample(self._replicas, min(2, len(self._replicas)))
        return min(drawn, key=lambda i: queues[i][0])


class TextRouting:
    name = "text"

    def __init__(self, config: TextRoutingConfig, chars_per_token: float, seed: int = 0) -> None:
        self.router: TextPrefixRouter[int] = TextPrefixRouter(config, seed)
        self._words = TokenWords(chars_per_token)

    @property
    def balanced(self) -> int:
        return self.router.balanced

    def pick(self, queues: Sequence[tuple[int, int]], text: str | None, tokens: Sequence[int],
             session: str | None) -> int:
        """queues: each replica's requests in flight and tokens not computed yet."""
        if text is None:
            text = self._words.text(tokens)
        loads = {i: ReplicaLoad(requests, work) for i, (requests, work) in enumerate(queues)}
        return self.router.route(text, loads, session)
