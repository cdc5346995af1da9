"""Filling llama.cpp's batch for one tick, in one write per array, and finding there the rows that sample."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS, BatchArrays
from cobali.engine.plan import Chunk
from cobali.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logits
from cobali.engine.request import Request, RequestState


class PromptLogits(NamedTuple):
    """A chunk whose every row's logits are read, for prompt logprobs."""

    request: Request
    start: int  # the chunk's first position
    out_row: int  # its first row of the logits
    n_rows: int


class Filled(NamedTuple):
    n_rows: int
    requests: list[Request]  # each chunk's, in row order
    # Found as the batch is filled, so that the decode's return waits for no pass over the rows: the requests
    # that sample (each chunk that yields a token; the tick samples it, even one that ends meanwhile), their
    # batch rows and their rows of the logits, in row order.
    samplers: list[Request]
    sample_rows: list[int]
    out_rows: list[int]
    prompt_logits: tuple[PromptLogits, ...]
    argmax_only: bool  # every sampling row is read for its greedy token only (SamplingParams.needs_only_argmax)


def fill_batch(arrays: BatchArrays, rows: tuple[Chunk, ...], requests: dict[int, Request], now: float) -> Filled:
    """Write the plan's rows (Plan.rows) into the backend's batch arrays. Every
    row goes into Python lists first and each array is written once: per-row numpy writes cost more than
    the rows themselves at hundreds of decode rows. A request's first chunk stamps its first scheduling."""
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    samplers: list[Request] = []
    sample_rows: list[int] = []
    out_rows: list[int] = []
    argmax_rows: list[int] = []  # the sampling rows read for their greedy token only
    prompt_logits: list[PromptLogits] = []
    every_row: list[range] = []  # the batch rows of the prompt_logits chunks
    out = 0  # logits rows so far
    row_requests = [requests[chunk.request_id] for chunk in rows]
    for chunk, request in zip(rows, row_requests, strict=True):
        if chunk.n_tokens == 1 and request.state is RequestState.DECODE:
            tokens.append(request.output_tokens[-1])
            positions.append(chunk.start)
            seq_ids.append(chunk.slot)
            out += 1
        else:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if wants_prompt_logits(request, chunk.start):
                every_row.append(range(len(tokens), len(tokens) + chunk.n_tokens))
                prompt_logits.append(PromptLogits(request, chunk.start, out, chunk.n_tokens))
                out += chunk.n_tokens - chunk.yields_token  # the sampling row is counted below
            tokens += request.tokens_to_feed(chunk.n_tokens)
            positions += range(chunk.start, chunk.end)
            seq_ids += [chunk.slot] * chunk.n_tokens
            out += chunk.yields_token
        if chunk.yields_token:
            samplers.append(request)
            sample_rows.append(len(tokens) - 1)
            out_rows.append(out - 1)
            if request.params.needs_only_argmax:
                argmax_rows.append(len(tokens) - 1)
    b, n = arrays, len(tokens)
    b.tokens[:n] = tokens
    b.positions[:n] = positions
    b.seq_ids[:n] = seq_ids
    b.want_logits[:n] = 0
    b.want_logits[sample_rows] = WANT_LOGITS
    b.want_logits[argmax_rows] = WANT_ARGMAX
    for span in every_row:  # prompt logprobs read these rows' logits, the chunk's sampling row included
        b.want_logits[span.start:span.stop] = WANT_LOGITS
    return Filled(n, row_requests, samplers, sample_rows, out_rows, tuple(prompt_logits),
                  len(argmax_rows) == len(sample_rows) and not prompt_logits)


def record_all_prompt_logprobs(filled: Filled, logits: np.ndarray) -> None:
    """After the decode: the prompt logprobs its chunks asked for."""
    for p in filled.prompt_logits:
        record_prompt_logprobs(p.request, p.start, logits[p.out_row:p.out_row + p.n_rows])
