"""One engine's typed configuration, built once at the CLI edge and handed down (to Ray actors too)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from cobali.backends.base import Backend
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.costs import load_profile
from cobali.engine.budget import CostModel
from cobali.engine.engine import Engine, EngineConfig


def build_backend(config: LlamaCppConfig) -> Backend:
    from cobali.backends.llama_cpp import LlamaCppBackend  # llama.cpp loads only when a model does

    return LlamaCppBackend(config)


@dataclass(frozen=True)
class EngineSpec:
    """The engine's config, its backend's, and the cost profile an ITL target reads."""

    engine: EngineConfig
    backend: LlamaCppConfig
    profile: str | None = None  # a path or a bundled profile's name; None: this CPU's

    def load_costs(self, backend: Backend | None = None) -> CostModel | None:
        """The cost profile an ITL target needs; None without a target. A profile measured on another
        device or model still runs, with a note: its predictions are off."""
        if self.engine.itl_target_ms <= 0:
            return None
        profile = load_profile(self.profile)
        if backend is not None and profile.device != backend.info.description:
            print(f"note: the cost profile is for '{profile.device}', not '{backend.info.description}'; "
                  "run `cobali calibrate` (and pass --profile) for accurate adaptive chunking", file=sys.stderr)
        return profile

    def build_engine(self, backend: Backend | None = None) -> Engine:
        backend = backend or build_backend(self.backend)
        return Engine(backend, self.engine, costs=self.load_costs(backend))
