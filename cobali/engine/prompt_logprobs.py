"""Prompt-token logprobs (completions' echo): logits at every prompt position, one entry per prompt token
after the first."""

from __future__ import annotations

import numpy as np

from cobali.engine.request import Request
from cobali.engine.sampling import token_logprob


def wants_prompt_logits(request: Request, start: int) -> bool:
    """A chunk starting at `start` needs logits on every row: its request asked for prompt logprobs and the
    chunk holds prompt tokens (the scheduler never reuses a cached prefix for such a request)."""
    return request.params.prompt_logprobs is not None and start < len(request.prompt_tokens)


def record_prompt_logprobs(request: Request, start: int, logits: np.ndarray) -> None:
    """Row i predicts the token at start+i+1. After a preemption the prompt is computed again: each
    position is recorded once."""
    prompt, k = request.prompt_tokens, request.params.prompt_logprobs
    for i, position in enumerate(range(start + 1, min(start + 1 + len(logits), len(prompt)))):
        if len(request.prompt_logprobs) == position - 1:
            request.prompt_logprobs.append(token_logprob(logits[i], prompt[position], k))
