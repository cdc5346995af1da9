"""OpenAI's two logprobs shapes (completions: parallel lists; chat: one object per token) from the engine's
per-token TokenLogprob entries."""

from __future__ import annotations

from collections.abc import Callable

from cobali.engine.request import Request
from cobali.engine.sampling import TokenLogprob


class LogprobWriter:
    """Renders a choice's logprobs; in a stream, each call renders only the tokens not sent yet."""

    def __init__(self, token_bytes: Callable[[int], bytes], chat: bool, n_choices: int) -> None:
        self.token_bytes = token_bytes
        self.chat = chat
        self._sent = [0] * n_choices
        self._text_offset = [0] * n_choices

    def render_new(self, index: int, request: Request) -> dict | None:
        entries = request.logprobs[self._sent[index]:]  # the engine thread only appends
        if not entries and self._sent[index]:
            return None
        self._sent[index] += len(entries)
        return self._chat(entries) if self.chat else self._completion(index, entries)

    def _text(self, token: int) -> str:
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token: int, logprob: float) -> dict:
            return {"token": self._text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                   for e in entries]
        return {"content": content, "refusal": None}

    def _completion(self, index: int, entries: list[TokenLogprob]) -> dict:
        tokens = [self._text(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(text)
        # Alternatives sharing one text (distinct ids, same piece) keep the likeliest, as a dict must.
        top = [{self._text(t): lp for t, lp in reversed(e.top)} for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top,
                "text_offset": offsets}
