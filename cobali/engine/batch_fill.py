"""Filling llama.cpp's batch for one tick, in one write per array, and finding there the rows that sample."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS, BatchArrays
from cobali.engine.plan import Chunk, ChunkKind
from cobali.engine.prompt_logprobs import read_prompt_logprobs, wants_prompt_logits
from cobali.engine.request import Request
from cobali.engine.sampling import TokenLogprob
from cobali.engine.speculative import Verify


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
    verifies: tuple[Verify, ...]  # decode rows followed by guessed tokens (engine/spec.py)


class _Rows(NamedTuple):
    """A tick's rows as Python lists, before one write per array."""

    tokens: list[int]
    positions: list[int]
    seq_ids: list[int]
    samplers: list[Request]
    sample_rows: list[int]
    out_rows: list[int]
    argmax_rows: list[int]  # the sampling rows read for their greedy token only
    spans: list[tuple[range, int]]  # other rows read: prompt logprobs' chunks, guesses (WANT_LOGITS or _ARGMAX)
    prompt_logits: list[PromptLogits]
    verifies: list[Verify]


def fill_batch(arrays: BatchArrays, rows: tuple[Chunk, ...], requests: Mapping[int, Request],
               drafts: Mapping[int, tuple[int, ...]]) -> Filled:
    """Write the plan's rows (Plan.rows, with Plan.drafts) into the backend's batch arrays. Every
    row goes into Python lists first and each array is written once: per-row numpy writes cost more than
    the rows themselves at hundreds of decode rows. The rows come from the chunks alone (their kind and
    positions): the requests already count the plan as run (Scheduler._commit)."""
    row_requests = [requests[chunk.request_id] for chunk in rows]
    r = _collect(rows, row_requests, drafts)
    b, n = arrays, len(r.tokens)
    b.tokens[:n] = r.tokens
    b.positions[:n] = r.positions
    b.seq_ids[:n] = r.seq_ids
    b.want_logits[:n] = 0
    b.want_logits[r.sample_rows] = WANT_LOGITS
    b.want_logits[r.argmax_rows] = WANT_ARGMAX
    for span, want in r.spans:
        b.want_logits[span.start:span.stop] = want
    return Filled(n, row_requests, r.samplers, r.sample_rows, r.out_rows, tuple(r.prompt_logits),
                  len(r.argmax_rows) == len(r.sample_rows) and not r.prompt_logits, tuple(r.verifies))


def _collect(rows: tuple[Chunk, ...], row_requests: list[Request], drafts: Mapping[int, tuple[int, ...]]) -> _Rows:
    r = _Rows([], [], [], [], [], [], [], [], [], [])
    tokens, positions, seq_ids, samplers, sample_rows, out_rows, argmax_rows = r[:7]
    out = 0  # logits rows so far
    decode = ChunkKind.DECODE
    for chunk, request in zip(rows, row_requests, strict=True):
        if chunk.kind is decode:  # a decode row (its input: the last token, or the stand-in of one in flight)
            row = len(tokens)
            tokens.append(request.output_tokens[chunk.start - len(request.prompt_tokens)])
            positions.append(chunk.start)
            seq_ids.append(chunk.slot)
            samplers.append(request)
            sample_rows.append(row)
            out_rows.append(out)
            argmax = request.params.needs_only_argmax
            if argmax:
                argmax_rows.append(row)
            out += 1
            if chunk.n_tokens > 1:  # the guesses are read as the decode row is, and verified after it samples
                draft = drafts[request.id]
                r.verifies.append(Verify(request, chunk.slot, draft, out, chunk.start + 1))
                r.spans.append((range(row + 1, row + chunk.n_tokens), WANT_ARGMAX if argmax else WANT_LOGITS))
                tokens += draft
                positions += range(chunk.start + 1, chunk.end)
                seq_ids += [chunk.slot] * len(draft)
                out += len(draft)
            continue
        if wants_prompt_logits(request, chunk.start):
            # Every row's logits, the chunk's sampling row included
            r.spans.append((range(len(tokens), len(tokens) + chunk.n_tokens), WANT_LOGITS))
            r.prompt_logits.append(PromptLogits(request, chunk.start, out, chunk.n_tokens))
            out += chunk.n_tokens - chunk.yields_token  # the sampling row is counted below
        tokens += request.tokens_between(chunk.start, chunk.end)
        positions += range(chunk.start, chunk.end)
        seq_ids += [chunk.slot] * chunk.n_tokens
        out += chunk.yields_token
        if chunk.yields_token:
            samplers.append(request)
            sample_rows.append(len(tokens) - 1)
            out_rows.append(out - 1)
            if request.params.needs_only_argmax:
                argmax_rows.append(len(tokens) - 1)
    return r


def read_all_prompt_logprobs(filled: Filled, logits: np.ndarray) -> tuple[tuple[Request, list[TokenLogprob]], ...]:
    """After the decode: the prompt logprobs its chunks asked for, by request, not recorded yet."""
    return tuple((p.request, read_prompt_logprobs(p.request, p.start, logits[p.out_row:p.out_row + p.n_rows]))
                 for p in filled.prompt_logits)
