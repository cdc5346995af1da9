"""How many tokens one tick may carry.

Fixed: always n_batch (the paper's setting, with a fixed --prefill-chunk-tokens). Adaptive: the tick-cost
model predicts the tick's time, and prefill gets as many tokens as fit under the ITL target
once this tick's decode rows are paid for, priced at the depth of the deepest prompt being prefilled
(a chunk deep into a long prompt attends to all of it). With nothing decoding there is no ITL to protect,
so prefill takes the whole n_batch; with a long decode set it still gets min_chunk, so TTFT stays bounded.
At light load the adaptive budget also lets prompts in whole while stalls are rare enough to stay out of
the ITL tail (StallTail): a few long stalls then cost the tail nothing, where many target-sized ones fill it.
Deadline: no fixed per-tick target; prefill gets the largest chunk whose predicted tick still delivers
every decoding request's next token by its deadline (a TPOT SLO, see DeadlineBudget).

The costs are learned online (engine/costs.py: OnlineCostFit) from every tick the engine times, seeded by a profile
when one is given. Until the fit is confident, a tick that decodes gets only min_chunk prefill tokens:
the smallest chunk that runs at full speed, a conservative fixed budget on any hardware.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cobali.engine.costs import CostProfile, OnlineCostFit, TickTerms
from cobali.engine.plan import Plan
from cobali.engine.request import Request


class TickBudget(Protocol):
    def tokens(self, decoding: Sequence[Request], prefill_depth: int = 0, now: float = 0.0) -> int:
        """The tick's token budget, decode rows included; prefill_depth: where the deepest prefill resumes;
        now: when the tick starts, on the engine's clock."""
        ...

    def observe(self, plan: Plan, seconds: float) -> None:
        """Learn from a tick that ran `plan` and took `seconds`."""
        ...


@dataclass(frozen=True)
class FixedBudget:
    n_batch: int

    def tokens(self, decoding: Sequence[Request], prefill_depth: int = 0, now: float = 0.0) -> int:
        return self.n_batch

    def observe(self, plan: Plan, seconds: float) -> None:
        pass  # nothing to learn: not even the plan's terms are worth a pass over its rows


@dataclass
class StallTail:
    """Whether letting a prompt in whole (n_batch tokens a tick) keeps its stall out of the ITL tail.

    A tick that prefills beside D decoding requests stalls D inter-token gaps. ITL p99 (as `vllm bench
    serve` pools it over every gap) is a decode gap while fewer than 1 % of the gaps stall, and the stall's
    length once more do. So at light load the tail is best served by few long stalls (prompts in whole, as
    llama-server does), and under load by short ones (the ITL target). This counts the stalled gaps that
    whole prompts would make, ceil(prompt / n_batch) ticks each, whatever the chunking really was, so the
    choice does not feed back on itself; both counts fade over the last `horizon_gaps` gaps. Until 1 / tail_share
    gaps have been seen nothing is rare: the target applies."""

    n_batch: int
    tail_share: float = 0.01
    horizon_gaps: float = 4000.0
    stalled: float = 0.0
    gaps: float = 0.0

    def observe(self, terms: TickTerms) -> None:
        rows = terms.decode_rows
        if rows == 0:
            return  # a prompt with nobody decoding stalls no one
        keep = math.exp(-rows / self.horizon_gaps)
        whole_ticks = sum(-(-end // self.n_batch) for end in terms.prompt_ends)
        self.stalled = self.stalled * keep + rows * whole_ticks
        self.gaps = self.gaps * keep + rows

    @property
    def share(self) -> float:
        """The recent share of gaps that whole prompts stall (0 before any gap)."""
        return self.stalled / self.gaps if self.gaps else 0.0

    def is_rare(self, n_decode: int) -> bool:
        """Would one more whole-prompt stall beside n_decode requests keep the stalled share under tail_share?"""
        return self.stalled + n_decode < self.tail_share * self.gaps


@dataclass(frozen=True)
class AdaptiveBudget:
    costs: OnlineCostFit
    itl_target_s: float
    n_batch: int
    min_chunk: int = 32
    tail: StallTail | None = None  # None: always the target

    def __post_init__(self) -> None:
        if self.itl_target_s <= 0:
            raise ValueError(f"the ITL target must be > 0 ms, got {self.itl_target_s * 1e3:g}")

    def prefill_tokens(self, n_decode: int, decode_kv_tokens: int, prefill_depth: int = 0) -> int:
        if n_decode == 0:
            return self.n_batch
        if self.tail is not None and self.tail.is_rare(n_decode):
            return self.n_batch - n_decode
        return prefill_within(self.itl_target_s, self.costs, self.n_batch, self.min_chunk,
                              TickTerms(0, n_decode, decode_kv_tokens), prefill_depth)

    def tokens(self, decoding: Sequence[Request], prefill_depth: int = 0, now: float = 0.0) -> int:
        n_decode = len(decoding)
        return n_decode + self.prefill_tokens(n_decode, sum(r.n_context_tokens for r in decoding), prefill_depth)

    def observe(self, plan: Plan, seconds: float) -> None:
        terms = TickTerms.of_plan(plan)
        self.costs.observe(terms, seconds)
        if self.tail is not None:
            self.tail.observe(terms)


def prefill_within(seconds: float, costs: OnlineCostFit, n_batch: int, min_chunk: int, decodes: TickTerms,
                   prefill_depth: int) -> int:
    """The most prefill tokens whose tick, beside `decodes`, is predicted to take at most `seconds`; never
    fewer than min_chunk (so TTFT stays bounded), and only min_chunk while the fit is not confident."""
    room = n_batch - decodes.decode_rows
    floor = min(min_chunk, room)
    if not costs.confident:
        return floor
    base = costs.predict(decodes)
    per_token = costs.predict(TickTerms(1, decodes.decode_rows, decodes.decode_kv_tokens, prefill_depth)) - base
    # A fit in which prefill is free is noise: it gets the conservative minimum, not the whole batch.
    fit = int((seconds - base) / per_token) if per_token > 0 else 0
    return max(min(fit, room), floor)


@dataclass(frozen=True)
class DeadlineBudget:
    """A TPOT SLO instead of a fixed per-tick target. The SLO holds for a request when its last token comes
    within (max_tokens - 1) x tpot_slo_s of its first (TPOT as `vllm bench serve` defines it). Its next
    token is due at the latest time that still leaves every later token, at this tick's decode-only cost,
    inside that bound, and never later than itl_max_s after its last token. Prefill gets the largest chunk
    whose predicted tick ends before the earliest such deadline. At light load decode ticks cost far less
    than the SLO, so the slack is large and a prompt goes in a few long chunks (few stalled gaps) instead
    of many medium ones; under load the decode ticks eat the slack and prefill gets min_chunk, or what fits in
    itl_floor_s (an ITL target kept as a floor: prompts still progress when no request has slack to lend).
    With nothing decoding, a prompt is not chunked below n_batch."""

    costs: OnlineCostFit
    tpot_slo_s: float
    itl_max_s: float  # the hard bound on one gap; inf: only the SLO (and n_batch) bound it
    n_batch: int
    min_chunk: int = 32
    itl_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.tpot_slo_s > 0 and self.itl_max_s > 0):
            raise ValueError(f"the TPOT SLO and the ITL bound must be > 0 ms, got {self.tpot_slo_s * 1e3:g} "
                             f"and {self.itl_max_s * 1e3:g}")

    def due(self, request: Request, decode_s: float, now: float) -> float:
        """When the request's next token is due, if each later one takes decode_s. A request that stops early
        (end of generation) ends with less TPOT slack than planned. With async scheduling a request may
        decode before its first token is known: that token is taken as sampled now."""
        times, n_max = request.token_times, request.params.max_tokens
        first, last = (times[0], times[-1]) if times else (now, now)
        later = max(n_max - max(len(times), 1) - 1, 0)
        last_due = first + (n_max - 1) * self.tpot_slo_s
        return min(last_due - later * decode_s, last + self.itl_max_s)

    def tokens(self, decoding: Sequence[Request], prefill_depth: int = 0, now: float = 0.0) -> int:
        if not decoding:
            return self.n_batch
        decodes = TickTerms(0, len(decoding), sum(r.n_context_tokens for r in decoding))
        decode_s = self.costs.predict(decodes)
        slack = max(min(self.due(r, decode_s, now) for r in decoding) - now, self.itl_floor_s)
        return len(decoding) + prefill_within(slack, self.costs, self.n_batch, self.min_chunk, decodes, prefill_depth)

    def observe(self, plan: Plan, seconds: float) -> None:
        self.costs.observe(TickTerms.of_plan(plan), seconds)


class BudgetSettings(Protocol):
    """The engine config's budget fields (EngineConfig, frozen: read-only here)."""

    @property
    def n_batch(self) -> int: ...

    @property
    def itl_target_ms(self) -> float: ...

    @property
    def tpot_slo_ms(self) -> float: ...

    @property
    def itl_max_ms(self) -> float: ...


def check_budget_settings(settings: BudgetSettings) -> None:
    for name in ("itl_target_ms", "tpot_slo_ms", "itl_max_ms"):
        if not getattr(settings, name) >= 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(settings, name)}")


def tick_budget(settings: BudgetSettings, costs: CostProfile | None, prefill_tile: int = 1) -> TickBudget:
    """costs: a profile that seeds the learned costs, or None to learn them from scratch. A TPOT SLO
    (> 0) picks the deadline budget, bounded by itl_max_ms (0: unbounded), with the ITL target as its floor;
    else an ITL target (> 0) the adaptive one; else the fixed n_batch."""
    n_batch, min_chunk = settings.n_batch, max(AdaptiveBudget.min_chunk, prefill_tile)
    if settings.tpot_slo_ms > 0:
        itl_max_s = settings.itl_max_ms / 1e3 if settings.itl_max_ms > 0 else float("inf")
        return DeadlineBudget(OnlineCostFit(seed=costs), settings.tpot_slo_ms / 1e3, itl_max_s, n_batch, min_chunk,
                              itl_floor_s=settings.itl_target_ms / 1e3)
    if settings.itl_target_ms <= 0:
        return FixedBudget(n_batch)
    return AdaptiveBudget(OnlineCostFit(seed=costs), settings.itl_target_ms / 1e3, n_batch, min_chunk,
                          StallTail(n_batch))
