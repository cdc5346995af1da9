"""A backend's cost profile: predicted time of one tick from what the batch carries.

    tick_s = t0_s + prefill_s_per_token * P + decode_s_per_row * D + decode_s_per_kv_token * KV
             + prefill_s_per_kv_token * PKV

P prefill tokens, D decode rows, KV the decode rows' context tokens summed, PKV the context each prefill
chunk attends to beyond itself (its tokens times its start position, summed): on this CPU a 64-token chunk
at position 1536 costs several times one at position 0. `cobali calibrate` measures the points and fits
the five coefficients by least squares; the adaptive budget and the simulator read the same JSON. The
model is linear: a tick mixing prefill and decode costs the sum of its parts. A profile also records the
model tokenizer's characters per token, so that the simulator sizes text prompts as the model would.

Bundled profiles (`--profile NAME`):
- `cpu-2core-smollm2`: this project's 2-core CPU and SmolLM2-135M Q4_1, measured by `cobali calibrate`.
- `h100-llama-8b`: an ESTIMATE for Llama-3.1-8B BF16 on one H100 SXM, derived from NVIDIA's datasheet
  (3.35 TB/s HBM3, 989 TFLOPS dense BF16) and the model's shape; not measured. See its `source` field.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROFILES_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = PROFILES_DIR / "cpu-2core-smollm2.json"
DEFAULT_CHARS_PER_TOKEN = 4.0  # BPE on English text, for profiles that did not measure their model's


@dataclass(frozen=True)
class Measurement:
    prefill_tokens: int
    decode_rows: int
    decode_kv_tokens: int
    seconds: float
    prefill_kv_tokens: int = 0


@dataclass(frozen=True)
class CostProfile:
    t0_s: float
    prefill_s_per_token: float
    decode_s_per_row: float
    decode_s_per_kv_token: float
    prefill_s_per_kv_token: float = 0.0
    device: str = ""
    source: str = ""
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN  # `cobali calibrate` measures the model's own
    measurements: tuple[Measurement, ...] = field(default=(), repr=False)

    def predict_tick_s(self, n_prefill_tokens: int, n_decode_rows: int, decode_kv_tokens: int,
                       prefill_kv_tokens: int = 0) -> float:
        return (self.t0_s + self.prefill_s_per_token * n_prefill_tokens + self.decode_s_per_row * n_decode_rows
                + self.decode_s_per_kv_token * decode_kv_tokens + self.prefill_s_per_kv_token * prefill_kv_tokens)

    def predict(self, m: Measurement) -> float:
        return self.predict_tick_s(m.prefill_tokens, m.decode_rows, m.decode_kv_tokens, m.prefill_kv_tokens)

    @classmethod
    def fit(cls, points: list[Measurement], device: str, source: str,
            chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> CostProfile:
        x = np.array([[1.0, m.prefill_tokens, m.decode_rows, m.decode_kv_tokens, m.prefill_kv_tokens]
                      for m in points])
        y = np.array([m.seconds for m in points])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        coef = np.maximum(coef, 0.0)  # a negative cost is noise, and would make the budget unbounded
        return cls(*map(float, coef), device=device, source=source, chars_per_token=chars_per_token,
                   measurements=tuple(points))

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        try:
            data = json.loads(Path(path).read_text())
            points = tuple(Measurement(**m) for m in data.pop("measurements", ()))
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
