"""OpenAI's two logprobs shapes (completions: parallel lists; chat: one object per token) from the engine's
per-token TokenLogprob entries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cobali.frontend.interface import TokenLogprob


class LogprobWriter:
    """Renders a choice's logprobs; in a stream, each call renders the entries of one output.

    With `echoed` (completions' echo), a choice's first rendering starts with its prompt tokens: the first one
    has no logprob (nothing predicts it) and shows null, as OpenAI's echo does.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], chat: bool, n_choices: int, k: int,
                 echoed: Sequence[Sequence[int]] | None = None) -> None:
        """k: the alternatives the request asked for per token; echoed: each choice's prompt tokens, if echoed."""
        self.token_bytes = token_bytes
        self.chat = chat
        self.k = k
        self.echoed = echoed
        self._started = [False] * n_choices
        self._text_offset = [0] * n_choices

    def render(self, index: int, entries: Sequence[TokenLogprob],
               prompt_logprobs: Sequence[TokenLogprob] | None = None) -> dict | None:
        """Choice `index`'s entries not rendered before (None: none, after its first rendering); its echoed
        prompt's (prompt_logprobs) open its first one."""
        first = not self._started[index]
        if not entries and not first:
            return None
        self._started[index] = True
        if self.chat:
            return self._chat(entries)
        if first and self.echoed is not None:  # the prompt's text comes first: rendered first, for the offsets
            return _joined(self._prompt(index, prompt_logprobs or ()), self._completion(index, entries))
        return self._completion(index, entries)

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _chat(self, entries: Sequence[TokenLogprob]) -> dict:
        def item(token: int, logprob: float) -> dict:
            return {"token": self._text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def _prompt(self, index: int, prompt_logprobs: Sequence[TokenLogprob]) -> dict:
        """The echoed prompt's lists; they come before the output's, so the output's offsets move on."""
        assert self.echoed is not None
        first = self._text(self.echoed[index][0])
        # prompt_logprobs may have recorded more alternatives
        rest = self._completion(index, [dataclasses.replace(e, top=e.top[: self.k]) for e in prompt_logprobs])
        self._text_offset[index] += len(first)
        return _joined({"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]},
                       {**rest, "text_offset": [o + len(first) for o in rest["text_offset"]]})

    def _completion(self, index: int, entries: Sequence[TokenLogprob]) -> dict:
        tokens = [self._text(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [self._top(e) for e in entries], "text_offset": offsets}

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        """The alternatives plus the chosen token, which OpenAI always lists (so logprobs=0 gives it alone).
        Alternatives sharing one text (distinct ids, same piece) keep the likeliest, as a dict must."""
        top = {self._text(t): lp for t, lp in reversed(entry.top)}
        top.setdefault(self._text(entry.token), entry.logprob)
        return top


def prompt_logprobs(entries: Sequence[TokenLogprob], token_bytes: Callable[[int], bytes], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (the first: null, nothing predicts it) its own and the top k
    alternatives', by token id: logprob, rank (1: the likeliest) and the decoded text. The engine may have recorded
    more alternatives (echo's logprobs asked for more): k cuts them."""
    def item(token: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_bytes(token).decode("utf-8", "replace")}

    rendered: list[dict | None] = [None]
    for e in entries:
        entry = {str(t): item(t, lp, rank) for rank, (t, lp) in enumerate(e.top[:k], 1)}
        entry[str(e.token)] = item(e.token, e.logprob, e.rank)
        rendered.append(entry)
    return rendered


def _joined(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in head}
