"""The tick-cost model: what one tick costs from what its batch carries, measured once or learned online.

    tick_s = t0 + per prefill token * P + per decode row * D + per decode KV token * KV
             + per prefill KV token * PKV + per short chunk's KV token * SKV

P prefill tokens, D decode rows, KV the decode rows' context tokens summed, PKV the context each prefill token
attends to beyond itself, summed (chunk_kv_tokens: a chunk of n from position p, n * p and the n * (n - 1) / 2 of
its own earlier tokens; a chunk deep into a long prompt costs more than one at its start, and a chunk of 512 more a
token than one of 64), SKV the part of PKV in chunks shorter than the backend's prefill tile. Such a chunk
attends row by row, not in tiles (llama.cpp's CPU flash attention: 9.3 ms a token for 32 tokens at depth 1,536
against 5.9 for 128, on this project's VM), and a warm turn's few new tokens deep into a long context are such
a chunk. The model is linear: a tick mixing prefill and decode costs the sum of its parts.

Two cost models share the terms (TickTerms) and the CostModel protocol:
- CostProfile: six coefficients fitted by least squares to `cobali calibrate`'s measurements, saved as JSON;
  the simulator runs on one, and one seeds the online fit. A profile also records the model tokenizer's
  characters per token, so that the simulator sizes text prompts as the model would. Bundled profiles
  (`--profile NAME`): `cpu-2core-smollm2` (this project's 2-core CPU and SmolLM2-135M Q4_1, measured),
  `cpu-1thread-smollm2` (the same on one thread, as each of two replicas runs there, with the short-chunk term), and
  `h100-llama-8b` (an ESTIMATE from NVIDIA's datasheet and the model's shape, not measured: see its `source`).
- OnlineCostFit: learned from the engine's own tick times by recursive least squares with exponential
  forgetting, so the fit follows a machine whose costs drift (another tenant, thermal limits, a longer
  context). With forgetting, a direction the recent ticks never excite (no prefill for a long decode-only
  stretch) would see its covariance grow without bound; forgetting stops while the covariance's trace is above
  its starting value, so an unexcited coefficient keeps its last estimate instead. Confidence: the relative
  error of each tick's prediction, made before the tick is learned, averaged over recent ticks. The fit is
  confident once it has seen enough ticks with prefill and with decode rows and that error is small; it loses
  confidence when the error grows (the costs changed) until it has re-learned them. A profile seeds the
  coefficients and starts the fit confident.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from cobali.engine.plan import ChunkKind, Plan

PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"
DEFAULT_PROFILE = PROFILES_DIR / "cpu-2core-smollm2.json"
DEFAULT_CHARS_PER_TOKEN = 4.0  # BPE on English text, for profiles that did not measure their model's

# Features are divided by typical sizes so that one prior variance suits all five coefficients.
_SCALE = np.array([1.0, 256.0, 16.0, 8192.0, 256.0 * 1024.0])


def chunk_kv_tokens(n_tokens: int, start: int) -> int:
    """The context a prefill chunk of n_tokens from position `start` attends to, token by token, beyond each token
    itself: the prompt before the chunk, and the chunk's own earlier tokens (causal attention)."""
    return n_tokens * start + n_tokens * (n_tokens - 1) // 2


@dataclass(frozen=True)
class TickTerms:
    """What one tick's batch carried, in the cost model's terms."""

    prefill_tokens: int
    decode_rows: int
    decode_kv_tokens: int
    prefill_kv_tokens: int = 0
    short_prefill_kv_tokens: int = 0  # the part of prefill_kv_tokens in chunks shorter than the prefill tile
    prompt_ends: tuple[int, ...] = ()  # the lengths of the prompts whose prefill ended this tick (no cost term)

    @classmethod
    def of_plan(cls, plan: Plan, prefill_tile: int = 1) -> TickTerms:
        """A decode row at position p reads p KV tokens; a prefill chunk of n tokens starting at p reads
        chunk_kv_tokens(n, p), counted again in short_prefill_kv_tokens when n < prefill_tile (the backend's,
        BackendInfo.prefill_tile)."""
        prefill = decode_rows = decode_kv = prefill_kv = short_kv = 0
        prompt_ends: list[int] = []
        for chunk in plan.chunks:  # one pass: every tick, over hundreds of decode rows
            if chunk.kind is ChunkKind.DECODE:
                decode_rows += 1
                decode_kv += chunk.start
                if chunk.n_tokens > 1:  # guessed tokens behind the row cost what a prompt chunk's tokens do
                    prefill += chunk.n_tokens - 1
                    deep = chunk_kv_tokens(chunk.n_tokens - 1, chunk.start + 1)
                    prefill_kv += deep
                    short_kv += deep if chunk.n_tokens - 1 < prefill_tile else 0
            else:
                prefill += chunk.n_tokens
                deep = chunk_kv_tokens(chunk.n_tokens, chunk.start)
                prefill_kv += deep
                short_kv += deep if chunk.n_tokens < prefill_tile else 0
                if chunk.yields_token:
                    prompt_ends.append(chunk.start + chunk.n_tokens)
        return cls(prefill, decode_rows, decode_kv, prefill_kv, short_kv, tuple(prompt_ends))

    def vector(self) -> np.ndarray:
        """The online fit's five features: it does not tell short chunks apart (a profile does)."""
        x = (1.0, self.prefill_tokens, self.decode_rows, self.decode_kv_tokens, self.prefill_kv_tokens)
        return np.array(x) / _SCALE


class CostModel(Protocol):
    """Predicts one tick's seconds from its terms: a measured profile, or the online fit."""

    def predict(self, terms: TickTerms) -> float: ...


@dataclass(frozen=True)
class Measurement:
    """One timed tick of `cobali calibrate`."""

    terms: TickTerms
    seconds: float


@dataclass(frozen=True)
class CostProfile:
    t0_s: float
    prefill_s_per_token: float
    decode_s_per_row: float
    decode_s_per_kv_token: float
    prefill_s_per_kv_token: float = 0.0
    short_chunk_s_per_kv_token: float = 0.0  # on top of prefill_s_per_kv_token, for chunks below the tile
    device: str = ""
    source: str = ""
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN  # `cobali calibrate` measures the model's own
    measurements: tuple[Measurement, ...] = field(default=(), repr=False)

    def predict(self, terms: TickTerms) -> float:
        return (self.t0_s + self.prefill_s_per_token * terms.prefill_tokens + self.decode_s_per_row * terms.decode_rows
                + self.decode_s_per_kv_token * terms.decode_kv_tokens
                + self.prefill_s_per_kv_token * terms.prefill_kv_tokens
                + self.short_chunk_s_per_kv_token * terms.short_prefill_kv_tokens)

    @classmethod
    def fit(cls, points: list[Measurement], device: str, source: str,
            chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> CostProfile:
        x = np.array([[1.0, m.terms.prefill_tokens, m.terms.decode_rows, m.terms.decode_kv_tokens,
                       m.terms.prefill_kv_tokens, m.terms.short_prefill_kv_tokens] for m in points])
        y = np.array([m.seconds for m in points])
        # A term no measurement excites (no short chunk timed) gets 0: lstsq's least-norm answer.
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        coef = np.maximum(coef, 0.0)  # a negative cost is noise, and would make the budget unbounded
        t0_s, per_token, per_row, per_kv_token, per_prefill_kv_token, per_short_kv_token = map(float, coef)
        return cls(t0_s, per_token, per_row, per_kv_token, per_prefill_kv_token, per_short_kv_token, device=device,
                   source=source, chars_per_token=chars_per_token, measurements=tuple(points))

    def save(self, path: str | Path) -> None:
        """Measurements are saved flat (their terms beside their seconds), as profiles have always been."""
        data = asdict(self)
        for m in data["measurements"]:
            terms = m.pop("terms")
            terms.pop("prompt_ends")
            m.update(terms)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            data = json.loads(Path(path).read_text())
            points = tuple(Measurement(TickTerms(**{k: v for k, v in m.items() if k != "seconds"}), m["seconds"])
                           for m in data.pop("measurements", ()))
            return cls(**data, measurements=points)
        except (OSError, json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"cannot read cost profile {path}: {err}") from None


def user_profiles_dir() -> Path:
    """Where `cobali calibrate` writes by default: the user's cache ($COBALI_CACHE, else ~/.cache/cobali),
    never the profiles bundled inside the package."""
    return Path(os.environ.get("COBALI_CACHE") or Path.home() / ".cache" / "cobali") / "profiles"


def profile_names() -> list[str]:
    return sorted({p.stem for d in (PROFILES_DIR, user_profiles_dir()) for p in d.glob("*.json")})


def resolve_profile(spec: str | None) -> Path:
    """A path as given, a profile's name (bundled, e.g. `h100-llama-8b`, or calibrated into the user's cache,
    e.g. `calibrated`), or None: this CPU's bundled profile."""
    if spec is None:
        return DEFAULT_PROFILE
    if Path(spec).is_file():
        return Path(spec)
    for folder in (PROFILES_DIR, user_profiles_dir()):
        candidate = folder / f"{spec}.json"
        if candidate.is_file():
            return candidate
    raise ValueError(f"--profile {spec!r}: no such file or bundled profile ({', '.join(profile_names())})")


def load_profile(spec: str | None) -> CostProfile:
    return CostProfile.load(resolve_profile(spec))


class OnlineCostFit:
    """A CostModel that learns: `observe` each tick, `predict` like a profile."""

    def __init__(self, seed: CostProfile | None = None, forgetting: float = 0.98, prior_var: float = 10.0,
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

    def predict(self, terms: TickTerms) -> float:
        return max(float(self.coef @ terms.vector()), 0.0)

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
