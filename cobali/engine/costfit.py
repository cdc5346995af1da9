"""The tick-cost model, learned online from the engine's own tick times.

    tick_s = fixed + per prefill token * P + per decode row * D + per decode KV token * KV
             + per prefill KV token * PKV

(the terms of a `cobali calibrate` profile). Every tick the engine reports what its batch carried and how
long the tick took; recursive least squares with exponential forgetting updates the five coefficients, so
the fit follows a machine whose costs drift (another tenant, thermal limits, a longer context). With
forgetting, a direction the recent ticks never excite (no prefill for a long decode-only stretch) would
see its covariance grow without bound; forgetting stops while the covariance's trace is above its
starting value, so an unexcited coefficient keeps its last estimate instead.

Confidence: the relative error of each tick's prediction, made before the tick is learned, is averaged
over recent ticks. The fit is confident once it has seen enough ticks with prefill and with decode rows
and that error is small; it loses confidence when the error grows (the costs changed) until it has
re-learned them. A profile seeds the coefficients and starts the fit confident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cobali.engine.plan import ChunkKind, Plan

# Features are divided by typical sizes so that one prior variance suits all five coefficients.
_SCALE = np.array([1.0, 256.0, 16.0, 8192.0, 256.0 * 1024.0])


@dataclass(frozen=True)
class TickTerms:
    """What one tick's batch carried, in the cost model's terms."""

    prefill_tokens: int
    decode_rows: int
    decode_kv_tokens: int
    prefill_kv_tokens: int = 0
    prompt_ends: tuple[int, ...] = ()  # the lengths of the prompts whose prefill ended this tick (no cost term)

    @classmethod
    def of_plan(cls, plan: Plan) -> TickTerms:
        """A decode row at position p reads p KV tokens; a prefill chunk of n tokens starting at p reads
        n * p beyond itself."""
        prefill = decode_rows = decode_kv = prefill_kv = 0
        prompt_ends: list[int] = []
        for chunk in plan.chunks:  # one pass: every tick, over hundreds of decode rows
            if chunk.kind is ChunkKind.DECODE:
                decode_rows += 1
                decode_kv += chunk.start
                if chunk.n_tokens > 1:  # guessed tokens behind the row cost what a prompt chunk's tokens do
                    prefill += chunk.n_tokens - 1
                    prefill_kv += (chunk.n_tokens - 1) * (chunk.start + 1)
            else:
                prefill += chunk.n_tokens
                prefill_kv += chunk.n_tokens * chunk.start
                if chunk.yields_token:
                    prompt_ends.append(chunk.start + chunk.n_tokens)
        return cls(prefill, decode_rows, decode_kv, prefill_kv, tuple(prompt_ends))

    def vector(self) -> np.ndarray:
        x = (1.0, self.prefill_tokens, self.decode_rows, self.decode_kv_tokens, self.prefill_kv_tokens)
        return np.array(x) / _SCALE


class CostCoefficients(Protocol):
    """A measured cost profile's coefficients (cobali.costs.CostProfile), in seconds."""

    t0_s: float
    prefill_s_per_token: float
    decode_s_per_row: float
    decode_s_per_kv_token: float
    prefill_s_per_kv_token: float


class OnlineCostFit:
    """A CostModel that learns: `observe` each tick, `predict_tick_s` like a profile."""

    def __init__(self, seed: CostCoefficients | None = None, forgetting: float = 0.98, prior_var: float = 10.0,
                 min_ticks: int = 16, max_error: float = 0.25, error_halflife: float = 8.0) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError(f"forgetting factor must be in (0.5, 1], got {forgetting}")
        self.forgetting = forgetting
        self.min_ticks = min_ticks
        self.max_error = max_error
        self._error_weight = 1.0 - 0.5 ** (1.0 / error_halflife)
        self._prior_var = prior_var
        self.cov = np.eye(5) * prior_var
        self._max_trace = float(np.trace(self.cov))
        self.coef = np.zeros(5)
        self.n_ticks = self.n_prefill_ticks = self.n_decode_ticks = 0
        self.error = 0.0  # recent mean relative error of a-priori predictions
        self.seeded = seed is not None
        if seed is not None:
            self.coef = np.array([seed.t0_s, seed.prefill_s_per_token, seed.decode_s_per_row,
                                  seed.decode_s_per_kv_token, seed.prefill_s_per_kv_token]) * _SCALE
            self.cov *= 1e-3  # trust the profile, yet let the ticks move it

    # ---- the CostModel protocol ------------------------------------------------------------------

    def predict_tick_s(self, n_prefill_tokens: int, n_decode_rows: int, decode_kv_tokens: int,
                       prefill_kv_tokens: int = 0) -> float:
        return self.predict(TickTerms(n_prefill_tokens, n_decode_rows, decode_kv_tokens, prefill_kv_tokens))

    def predict(self, terms: TickTerms) -> float:
        return max(float(self.coef @ terms.vector()), 0.0)

    # ---- learning --------------------------------------------------------------------------------

    def observe(self, terms: TickTerms, seconds: float) -> None:
        if not seconds > 0:  # a clock that did not advance says nothing
            return
        x = terms.vector()
        predicted = self.predict(terms)
        if self.n_ticks or self.seeded:
            was_confident = self.confident
            relative = min(abs(predicted - seconds) / seconds, 1.0)  # one stall must not swamp the average
            self.error += self._error_weight * (relative - self.error)
            if was_confident and not self.confident:  # the costs changed: re-learn them fast
                self.cov = np.eye(5) * self._prior_var
        # Tick times are noisy in proportion to their size: fit relative errors, so that one long prefill
        # tick does not outweigh a run of short decode ticks.
        x = x / seconds
        cov_x = self.cov @ x
        gain = cov_x / (self.forgetting + x @ cov_x)
        self.coef = self.coef + gain * (1.0 - x @ self.coef)
        self.cov = self.cov - np.outer(gain, cov_x)
        if np.trace(self.cov) < self._max_trace:
            self.cov /= self.forgetting
        self.n_ticks += 1
        self.n_prefill_ticks += terms.prefill_tokens > 0
        self.n_decode_ticks += terms.decode_rows > 0

    @property
    def confident(self) -> bool:
        if self.error > self.max_error:
            return False
        if self.seeded:
            return True
        enough = self.min_ticks // 4
        return self.n_ticks >= self.min_ticks and min(self.n_prefill_ticks, self.n_decode_ticks) >= enough

    def describe(self) -> str:
        t0, p, d, kv, pkv = self.coef / _SCALE
        state = "confident" if self.confident else "learning"
        return (f"tick = {t0 * 1e3:.2f} ms + {p * 1e3:.3f} ms/prefill token + {d * 1e3:.3f} ms/decode row"
                f" + {kv * 1e6:.3f} us/decode KV token + {pkv * 1e6:.4f} us/prefill KV token"
                f" ({state} after {self.n_ticks} ticks, recent error {self.error:.1%})")
