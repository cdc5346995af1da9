"""How many tokens one tick may carry.

Fixed: always n_batch (the paper's setting, with a fixed --prefill-chunk-tokens). Adaptive: the tick-cost
model predicts the tick's time, and prefill gets as many tokens as fit under the ITL target
once this tick's decode rows are paid for, priced at the depth of the deepest prompt being prefilled
(a chunk deep into a long prompt attends to all of it). With nothing decoding there is no ITL to protect,
so prefill takes the whole n_batch; with a long decode set it still gets min_chunk, so TTFT stays bounded.

The costs are learned online (engine/costfit.py) from every tick the engine times, seeded by a profile
when one is given. Until the fit is confident, a tick that decodes gets only min_chunk prefill tokens:
the smallest chunk that runs at full speed, a conservative fixed budget on any hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cobali.engine.costfit import CostCoefficients, OnlineCostFit, TickTerms


class CostModel(Protocol):
    def predict_tick_s(self, n_prefill_tokens: int, n_decode_rows: int, decode_kv_tokens: int,
                       prefill_kv_tokens: int = 0) -> float: ...


class TickBudget(Protocol):
    def tokens(self, n_decode: int, decode_kv_tokens: int, prefill_depth: int = 0) -> int:
        """The tick's token budget, decode rows included; prefill_depth: where the deepest prefill resumes."""
        ...

    def observe(self, terms: TickTerms, seconds: float) -> None:
        """Learn from a tick that carried `terms` and took `seconds`."""
        ...


@dataclass(frozen=True)
class FixedBudget:
    n_batch: int

    def tokens(self, n_decode: int, decode_kv_tokens: int, prefill_depth: int = 0) -> int:
        return self.n_batch

    def observe(self, terms: TickTerms, seconds: float) -> None:
        pass


@dataclass(frozen=True)
class AdaptiveBudget:
    costs: OnlineCostFit
    itl_target_s: float
    n_batch: int
    min_chunk: int = 32

    def __post_init__(self) -> None:
        if self.itl_target_s <= 0:
            raise ValueError(f"the ITL target must be > 0 ms, got {self.itl_target_s * 1e3:g}")

    def prefill_tokens(self, n_decode: int, decode_kv_tokens: int, prefill_depth: int = 0) -> int:
        room = self.n_batch - n_decode
        if n_decode == 0:
            return room
        if not self.costs.confident:
            return min(self.min_chunk, room)
        base = self.costs.predict_tick_s(0, n_decode, decode_kv_tokens)
        per_token = self.costs.predict_tick_s(1, n_decode, decode_kv_tokens, prefill_depth) - base
        # A fit in which prefill is free is noise: it gets the conservative minimum, not the whole batch.
        fit = int((self.itl_target_s - base) / per_token) if per_token > 0 else 0
        return max(min(fit, room), min(self.min_chunk, room))

    def tokens(self, n_decode: int, decode_kv_tokens: int, prefill_depth: int = 0) -> int:
        return n_decode + self.prefill_tokens(n_decode, decode_kv_tokens, prefill_depth)

    def observe(self, terms: TickTerms, seconds: float) -> None:
        self.costs.observe(terms, seconds)


def tick_budget(n_batch: int, itl_target_ms: float, costs: CostCoefficients | None,
                prefill_tile: int = 1) -> TickBudget:
    """costs: a profile that seeds the learned costs, or None to learn them from scratch."""
    if itl_target_ms <= 0:
        return FixedBudget(n_batch)
    return AdaptiveBudget(OnlineCostFit(seed=costs), itl_target_ms / 1e3, n_batch,
                          min_chunk=max(AdaptiveBudget.min_chunk, prefill_tile))
