"""llama.cpp through llama-cpp-python's low-level C bindings. The only package that imports llama_cpp.

Its names load lazily: `cobali.backends.llama_cpp.config` (the typed settings) imports without llama.cpp, for
the simulator and the flags."""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {"LlamaCppBackend": "backend", "LlamaCppSampler": "sampler", "LlamaCppVocabulary": "vocab",
          "quantize_model": "tools"}

__all__ = ["LlamaCppBackend", "LlamaCppSampler", "LlamaCppVocabulary", "quantize_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
