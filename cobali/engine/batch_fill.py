"""Filling llama.cpp's batch for one tick, in one write per array, and finding each request's rows after."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS, BatchArrays
from cobali.engine.plan import Chunk
from cobali.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logits
from cobali.engine.request import Request, RequestState


class Filled(NamedTuple):
    n_rows: int
    requests: list[Request]  # each chunk's, in row order: the tick samples them, even one that ends meanwhile
    every_row_samples: bool  # one row per chunk and each yields a token: row i is logits row i is request i
    argmax_only: bool  # every sampling row is read for its greedy token only (SamplingParams.needs_only_argmax)


def fill_batch(arrays: BatchArrays, rows: tuple[Chunk, ...], requests: dict[int, Request], now: float) -> Filled:
    """Write the plan's rows (Plan.rows) into the backend's batch arrays. Every
    row goes into Python lists first and each array is written once: per-row numpy writes cost more than
    the rows themselves at hundreds of decode rows. A request's first chunk stamps its first scheduling."""
    tokens: list[int] = []
    positions: list[int] = []
    seq_ids: list[int] = []
    ends: list[int] = []  # the row after each sampling row whose logits the host reads
    argmax_ends: list[int] = []  # ... and after each that needs only its greedy token
    every_row: list[range] = []  # chunks whose every row wants logits (prompt logprobs)
    row_requests = [requests[chunk.request_id] for chunk in rows]
    for chunk, request in zip(rows, row_requests, strict=True):
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
    return Filled(n, row_requests, len(ends) + len(argmax_ends) == n and not every_row, not ends)


def sampling_rows(rows: tuple[Chunk, ...], row_requests: list[Request], logits: np.ndarray
                  ) -> tuple[list[Request], list[int], list[int]]:
    """After the decode: the requests that sample (not those that ended meanwhile), their batch rows and their
    rows of `logits`; records the prompt logprobs asked for on the way."""
    sampled, batch_rows, out_rows, row, out = [], [], [], 0, 0  # out: logits rows used
    for chunk, request in zip(rows, row_requests, strict=True):
        row += chunk.n_tokens
        if wants_prompt_logits(request, chunk.start):
            record_prompt_logprobs(request, chunk.start, logits[out:out + chunk.n_tokens])
            out += chunk.n_tokens
        elif chunk.yields_token:
            out += 1
        if chunk.yields_token and not request.is_finished:
            sampled.append(request)
            batch_rows.append(row - 1)
            out_rows.append(out - 1)
    return sampled, batch_rows, out_rows
