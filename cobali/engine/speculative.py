"""Speculative decoding by prompt lookup (vLLM's "ngram" method, llama.cpp's lookup decoding).

A greedy request's next tokens are guessed from its own context: the most recent earlier place where its last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred, and the tokens that followed there.
The tick feeds the guesses as extra rows behind the request's decode row; one forward pass scores them all,
and the request keeps its greedy token at each row for as long as the guesses match those tokens. The tokens
kept are exactly those plain greedy decoding picks from the same logits, so the output is unchanged; a tick
that guessed right gives several tokens for one pass. Rows whose guess failed are trimmed from the KV.

Which requests guess: greedy ones (SamplingParams.is_greedy) without min_tokens, whose token the argmax
decides; a sampled request would need rejection sampling over its chain's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from cobali.engine.request import Drafted, Request
from cobali.engine.sampling import token_logprob

if TYPE_CHECKING:
    import numpy as np

    from cobali.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SpecConfig:
    """num_speculative_tokens: most guessed tokens a request feeds a tick (0: no speculation). max_batch: guess
    only in ticks with at most this many decode rows. On a CPU a guessed row costs about what a prompt token
    does, which a right guess repays only while the tick's fixed cost is shared by few rows; and with
    per-sequence KV streams llama.cpp runs the rows of a sequence with more tokens than the others as one more
    forward pass. So guesses pay at one or two decode rows and cost beyond (docs/results.md, "Speculative
    decoding")."""

    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_batch: int = 1

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


def can_speculate(params: SamplingParams) -> bool:
    """The argmax alone picks the request's tokens, so a guessed row can be checked against it."""
    return params.is_greedy and params.min_tokens == 0


class Drafter(Protocol):
    """What the scheduler asks of a guesser (the tests plant others)."""

    max_batch: int  # guesses only in ticks with at most this many decode rows

    def propose(self, request: Request, limit: int) -> tuple[int, ...]: ...

    def forget(self, request_id: int) -> None: ...


@dataclass
class _Index:
    """Where each n-gram of a request's tokens last occurred: the position of the token after it."""

    table: dict[tuple[int, ...], int] = field(default_factory=dict)
    n_indexed: int = 0  # tokens whose preceding n-grams are in the table


class NgramDrafter:
    """Guesses continuations from each request's own tokens. Keeps an index per request, grown by the tokens
    added since the last guess (a dict per request: O(1) a token, not a scan of the context every tick; the
    prompt is indexed once, at the first guess)."""

    def __init__(self, config: SpecConfig) -> None:
        assert config.enabled
        self.config = config
        self.max_batch = config.max_batch
        self._indexes: dict[int, _Index] = {}

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        """Up to `limit` (and num_speculative_tokens) tokens to follow the request's last one; () for none."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0:
            return ()
        index = self._indexes.get(request.id)
        if index is None:
            index = self._indexes[request.id] = _Index()
        prompt, outputs = request.prompt_tokens, request.output_tokens
        end = len(prompt) + len(outputs)
        self._extend(index, prompt, outputs, end)
        for n in range(min(self.config.prompt_lookup_max, end - 1), self.config.prompt_lookup_min - 1, -1):
            follower = index.table.get(tuple(_span(prompt, outputs, end - n, end)))
            if follower is not None:
                return tuple(_span(prompt, outputs, follower, min(follower + limit, end)))
        return ()

    def _extend(self, index: _Index, prompt: list[int], outputs: list[int], end: int) -> None:
        """Map the n-grams that end before each new token (not the last one's: nothing follows it yet) to it."""
        table, low, high = index.table, self.config.prompt_lookup_min, self.config.prompt_lookup_max
        for t in range(max(index.n_indexed, low), end):
            for n in range(low, min(high, t) + 1):
                table[tuple(_span(prompt, outputs, t - n, t))] = t
        index.n_indexed = end

    def forget(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)


def _span(prompt: list[int], outputs: list[int], start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of prompt + outputs, without joining the two (a copy of the context a tick)."""
    n = len(prompt)
    if start >= n:
        return outputs[start - n:stop - n]
    return prompt[start:stop] if stop <= n else prompt[start:] + outputs[:stop - n]


class Verify(NamedTuple):
    """A decode row followed by guessed tokens, in one tick's batch."""

    request: Request
    slot: int
    draft: tuple[int, ...]
    out_row: int  # the logits row of the first guess (the row after the decode row's)
    position: int  # the first guess's position in the request's KV


def verify(verifies: tuple[Verify, ...], requests: list[Request], tokens: list[int | None], best: np.ndarray,
           logits: np.ndarray) -> dict[int, Drafted]:
    """After the decode and the sampling of each decode row (`tokens`, one per request of `requests`): what each
    request's guesses gave, by request id. The engine then counts the guessed rows out of the request's KV and
    each one back in as its token is kept; the cells past the last one kept are trimmed."""
    first = {request.id: token for request, token in zip(requests, tokens, strict=True)}
    drafted: dict[int, Drafted] = {}
    for request, slot, draft, out_row, position in verifies:
        token = first[request.id]
        kept = [] if token is None else verified_tokens(draft, token, best, out_row)
        k = request.params.logprobs
        logprobs = [None if k is None else token_logprob(logits[out_row + j], t, k) for j, t in enumerate(kept)]
        drafted[request.id] = Drafted(slot, position, position + len(draft), kept, logprobs)
    return drafted


def verified_tokens(draft: tuple[int, ...], first: int, best: np.ndarray, out_row: int) -> list[int]:
    """The greedy tokens the guessed rows give, as long as each guess was the token before it: guess j fed
    at row out_row + j is right when it equals the previous greedy token (`first` the decode row's)."""
    tokens: list[int] = []
    previous = first
    for j, guess in enumerate(draft):
        if guess != previous:
            break
        previous = int(best[out_row + j])
        tokens.append(previous)
    return tokens
