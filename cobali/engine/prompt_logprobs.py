"""Prompt-token logprobs (completions' echo): logits at every prompt position, one entry per prompt token
after the first."""

from __future__ import annotations

import numpy as np

from cobali.engine.request import Request
from cobali.engine.sampling import TokenLogprob, token_logprob


def wants_prompt_logits(request: Request, start: int) -> bool:
    """A chunk starting at `start` needs logits on every row: its request asked for prompt logprobs and the
    chunk holds prompt tokens (the scheduler never reuses a cached prefix for such a request)."""
    return request.params.prompt_logprobs is not None and start < len(request.prompt_tokens)


def read_prompt_logprobs(request: Request, start: int, logits: np.ndarray) -> list[TokenLogprob]:
    """Row i predicts the token at start+i+1: the entries of the positions not recorded yet (after a
    preemption the prompt is computed again, and each position is recorded once)."""
    prompt, k = request.prompt_tokens, request.params.prompt_logprobs
    assert k is not None
    skip = len(request.prompt_logprobs) - start  # rows whose position is recorded already
    if skip < 0:
        return []
    positions = range(start + 1 + skip, min(start + 1 + len(logits), len(prompt)))
    return [token_logprob(logits[position - start - 1], prompt[position], k) for position in positions]
