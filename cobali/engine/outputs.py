"""What the engine hands out: one message per request whose text is due or that ended, and a snapshot of its
counters. Nothing here refers back to the engine's live objects: a consumer reads only what it was given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cobali.engine.request import FinishReason, Request
from cobali.engine.sampling import TokenLogprob


@dataclass(frozen=True)
class RequestStats:
    """One request's timestamps (the engine's clock) and counts, on its final output."""

    arrival_time: float
    first_scheduled_time: float | None
    token_times: tuple[float, ...]  # when each output token was taken
    finish_time: float
    n_prompt_tokens: int
    n_output_tokens: int
    cached_tokens: int  # prompt tokens its KV came from a cached or running prefix for (at its last admission)
    preemptions: int  # times it was sent back to the queue, its KV dropped


class RequestOutput(NamedTuple):
    """A request's news since its previous output: new text and tokens, or its end. A NamedTuple, not a
    dataclass: a streamed tick makes one per request, and a tuple is built faster; frozen all
    the same."""

    request_id: int
    text: str  # new text since the last output
    token_ids: tuple[int, ...]  # new output tokens since the last output (an end token among them: no text)
    n_tokens: int  # output tokens so far, these included
    logprobs: tuple[TokenLogprob, ...]  # one per new token, when the request asked for them
    finished: bool
    n_prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on a request's first output, when asked for
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    error: str | None = None
    own_fault: bool = False  # its own input failed it (a grammar that allows no token), not the engine
    stats: RequestStats | None = None  # on the final output

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output followed by a later one of the same request, as one."""
        assert later.request_id == self.request_id
        return later._replace(text=self.text + later.text, token_ids=self.token_ids + later.token_ids,
                              logprobs=self.logprobs + later.logprobs,
                              prompt_logprobs=self.prompt_logprobs if later.prompt_logprobs is None
                              else later.prompt_logprobs)


def output_of(request: Request, text: str, count: int) -> RequestOutput:
    """A request's news up to its first `count` outputs, since the last one it handed out: the first one carries
    its prompt's logprobs (all computed by then: its first token was sampled)."""
    start, request.n_reported = request.n_reported, count
    params = request.params
    logprobs = tuple(request.logprobs[start:count]) if params.logprobs is not None else ()
    prompt_logprobs = tuple(request.prompt_logprobs) if start == 0 and params.prompt_logprobs is not None else None
    return RequestOutput(request.id, text, tuple(request.output_tokens[start:count]), count, logprobs,
                         request.is_finished, len(request.prompt_tokens), request.cached_tokens, prompt_logprobs)


def final_output_of(request: Request, text: str) -> RequestOutput:
    """A finished request's last output: the rest of its text and tokens, why it ended, and its stats."""
    assert request.is_finished and request.finish_time is not None and not request.n_pending
    n = len(request.output_tokens)
    stats = RequestStats(request.arrival_time, request.first_scheduled_time, tuple(request.token_times),
                         request.finish_time, len(request.prompt_tokens), n, request.cached_tokens,
                         request.preemptions)
    return output_of(request, text, n)._replace(finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                                                error=request.error, own_fault=request.own_fault, stats=stats)


def refused(request_id: int, error: str, now: float) -> RequestOutput:
    """The final output of a request that was never queued: its prompt can never run."""
    stats = RequestStats(now, None, (), now, 0, 0, 0, 0)
    return RequestOutput(request_id, "", (), 0, (), True, 0, 0, finish_reason=FinishReason.ERROR, error=error,
                         stats=stats)


@dataclass(frozen=True, kw_only=True)  # fourteen numbers: named where it is built
class EngineStats:
    """The engine's gauges and running totals at one moment (read from another thread: a snapshot)."""

    n_running: int  # requests holding a slot
    n_waiting: int
    kv_used_tokens: int  # KV cells the running requests fill (cached prefixes in free slots not counted)
    n_ctx: int
    preemptions: int
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int  # of those, the tokens whose KV was reused
    prefix_host_hit_tokens: int  # of those, the tokens restored from host memory
    draft_tokens: int  # tokens guessed by prompt lookup and fed behind decode rows
    accepted_draft_tokens: int
    host_cache_bytes: int
    # What the adaptive budgets learn (None when the tick budget is fixed): the recent relative error of the tick
    # costs' predictions, whether the budget trusts them, and the share of gaps a whole prompt would stall.
    tick_cost_error: float | None = None
    tick_cost_confident: bool | None = None
    whole_prompt_stall_share: float | None = None
