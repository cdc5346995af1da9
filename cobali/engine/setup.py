"""One engine's typed configuration, built once at the CLI edge and handed down (to Ray actors too)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cobali.backends.base import Backend
from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.costs import CostProfile, load_profile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig


def build_backend(config: LlamaCppConfig) -> Backend:
    from cobali.backends.llama_cpp import LlamaCppBackend  # llama.cpp loads only when a model does

    return LlamaCppBackend(config)


@dataclass(frozen=True)
class EngineSetup:
    """The engine's config, its backend's, and the cost profile that seeds an ITL target's learned costs."""

    engine: EngineConfig
    backend: LlamaCppConfig
    profile: str | None = None  # a path or a bundled profile's name; None: learn the tick costs from scratch

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineSetup:
        """A Python caller's engine (vLLM's `LLM(model=..., **options)`): each option is a field of EngineConfig
        or of LlamaCppConfig, by name (max_slots, n_ctx, n_gpu_layers, async_scheduling, ...). model: a GGUF
        path, None: the embedded model. As the CLI does, the backend is sized for max_slots sequences and one
        n_batch serves both."""
        engine_fields = {f.name for f in fields(EngineConfig)}
        backend_fields = {f.name for f in fields(LlamaCppConfig)} - {"model_path"}
        unknown = sorted(set(options) - engine_fields - backend_fields)
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)}: an option is a field of EngineConfig or "
                             "LlamaCppConfig")
        engine = EngineConfig(**{k: v for k, v in options.items() if k in engine_fields})
        backend = {"n_seq_max": engine.max_slots, "n_batch": engine.n_batch,
                   **{k: v for k, v in options.items() if k in backend_fields}}
        return cls(engine, LlamaCppConfig(model_path=model, **backend))

    def model_name(self) -> str:
        """The model's name where none is given (a server's --served-model-name): its GGUF file's, less the suffix."""
        return Path(self.backend.model_path or embedded_model_path()).stem

    def load_costs(self, backend: Backend | None = None) -> CostProfile | None:
        """The profile that seeds the tick costs an ITL target learns online; None without a target or a
        profile (the engine then learns from scratch). A profile measured on another device or model still
        runs, with a note: its first predictions are off until the engine has re-learned them."""
        if max(self.engine.itl_target_ms, self.engine.tpot_slo_ms) <= 0 or self.profile is None:
            return None
        profile = load_profile(self.profile)
        if backend is not None and profile.device != backend.info.description:
            print(f"note: the cost profile is for '{profile.device}', not '{backend.info.description}'; "
                  "the engine re-learns its tick costs over the first ticks", file=sys.stderr)
        return profile

    def build_engine(self, backend: Backend | None = None) -> Engine:
        backend = backend or build_backend(self.backend)
        return Engine(backend, self.engine, costs=self.load_costs(backend))
