"""OpenAI's two logprobs shapes (completions: parallel lists; chat: one object per token) from the engine's
per-token TokenLogprob entries."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cobali.engine.request import Request
from cobali.engine.sampling import TokenLogprob


class LogprobWriter:
    """Renders a choice's logprobs; in a stream, each call renders only the tokens not sent yet.

    With `echo` (completions only), a choice's first rendering starts with its prompt tokens: the first one
    has no logprob (nothing predicts it) and shows null, as OpenAI's echo does.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], chat: bool, n_choices: int, echo: bool = False) -> None:
        self.token_bytes = token_bytes
        self.chat = chat
        self.echo = echo
        self._sent = [0] * n_choices
        self._text_offset = [0] * n_choices

    def render_new(self, index: int, request: Request, end: int | None = None) -> dict | None:
        """The entries from the last call's end up to `end` (None: all there are now)."""
        first = self._sent[index] == 0
        entries = request.logprobs[self._sent[index]:end]  # the engine thread only appends
        if not entries and not first:
            return None
        self._sent[index] += len(entries)
        if self.chat:
            return self._chat(entries)
        if first and self.echo:  # the prompt's text comes first: rendered first, for the offsets
            return _joined(self._prompt(index, request), self._completion(index, entries))
        return self._completion(index, entries)

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token: int, logprob: float) -> dict:
            return {"token": self._text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def _prompt(self, index: int, request: Request) -> dict:
        """The echoed prompt's lists; they come before the output's, so the output's offsets move on."""
        first = self._text(request.prompt_tokens[0])
        k = request.params.logprobs  # prompt_logprobs may have recorded more alternatives
        rest = self._completion(index, [dataclasses.replace(e, top=e.top[:k]) for e in request.prompt_logprobs])
        self._text_offset[index] += len(first)
        return _joined({"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]},
                       {**rest, "text_offset": [o + len(first) for o in rest["text_offset"]]})

    def _completion(self, index: int, entries: list[TokenLogprob]) -> dict:
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


def prompt_logprobs(request: Request, token_bytes: Callable[[int], bytes], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (the first: null, nothing predicts it) its own and the top k
    alternatives', by token id: logprob, rank (1: the likeliest) and the decoded text. The engine may have recorded
    more alternatives (echo's logprobs asked for more): k cuts them."""
    def item(token: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_bytes(token).decode("utf-8", "replace")}

    rendered: list[dict | None] = [None]
    for e in request.prompt_logprobs:
        entry = {str(t): item(t, lp, rank) for rank, (t, lp) in enumerate(e.top[:k], 1)}
        entry[str(e.token)] = item(e.token, e.logprob, e.rank)
        rendered.append(entry)
    return rendered


def _joined(head: dict, tail: dict) -> dict:
    return {key: head[key] + tail[key] for key in head}
