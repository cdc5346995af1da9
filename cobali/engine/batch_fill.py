"""Filling llama.cpp's batch for one tick, in one write per array."""

from __future__ import annotations

import numpy as np

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS, BatchArrays
from cobali.engine.plan import Chunk
from cobali.engine.prompt_logprobs import wants_prompt_logits
from cobali.engine.request import Request, RequestState


def fill_batch(arrays: BatchArrays, rows: tuple[Chunk, ...], requests: dict[int, Request], now: float) -> int:
    """Write the plan's rows (Plan.rows) into the backend's batch arrays; returns the number of rows. Every
    row goes into Python lists first and each array is written once: per-row numpy writes cost more than
    the rows themselves at hundreds of decode rows. A request's first chunk stamps its first scheduling."""
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    ends: list[int] = []  # the row after each sampling row whose logits the host reads
    argmax_ends: list[int] = []  # ... and after each that needs only its greedy token
    every_row: list[range] = []  # chunks whose every row wants logits (prompt logprobs)
    for chunk in rows:
        request = requests[chunk.request_id]
        if chunk.n_tokens == 1 and request.state is RequestState.DECODE:
            tokens.append(request.output_tokens[-1])
            positions.append(chunk.start)
            seq_ids.append(chunk.slot)
        else:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if wants_prompt_logits(request, chunk.start):
                every_row.append(range(len(tokens), len(tokens) + chunk.n_tokens))
            tokens += request.tokens_to_feed(chunk.n_tokens)
            positions += range(chunk.start, chunk.end)
            seq_ids += [chunk.slot] * chunk.n_tokens
        if chunk.yields_token:
            (argmax_ends if request.params.needs_only_argmax else ends).append(len(tokens))
    b, n = arrays, len(tokens)
    b.tokens[:n] = tokens
    b.positions[:n] = positions
    b.seq_ids[:n] = seq_ids
    b.want_logits[:n] = 0
    b.want_logits[np.array(ends, dtype=np.intp) - 1] = WANT_LOGITS
    b.want_logits[np.array(argmax_ends, dtype=np.intp) - 1] = WANT_ARGMAX
    for span in every_row:  # prompt logprobs read these rows' logits, the chunk's sampling row included
        b.want_logits[span.start:span.stop] = WANT_LOGITS
    return n
