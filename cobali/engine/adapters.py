"""The LoRA adapters requests may name: those loaded with the model, and those loaded and unloaded while
serving (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter).

An index is never used twice, so KV computed under an unloaded adapter (the prefix cache keys it by index,
Request.kv_key) can never be matched by another one; it ages out of the cache like any unused prefix. So an
engine loads at most MAX_ADAPTER_INDEX adapters in its life (a load that fails uses up none), and refuses more.
An unloaded adapter takes no new request at once, and is freed when the last request that named it ends.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from cobali.backends.base import Backend
from cobali.engine.request import MAX_ADAPTER_INDEX, Request


class AdapterLimit(ValueError):
    """Every adapter index of this engine's life is used up: only a restart loads more."""


class Adapters:
    def __init__(self, backend: Backend, requests: Mapping[int, Request], updates: bool = False) -> None:
        """updates: adapters may be loaded while serving."""
        self.backend = backend
        self.requests = requests  # the engine's live requests
        # Replaced whole, never changed in place: check() reads it from the event loop while the engine's thread
        # loads and unloads.
        self.loaded: frozenset[int] = frozenset(range(1, backend.info.n_loras + 1))
        self.retiring: set[int] = set()
        self.enabled = bool(self.loaded) or updates  # False: every request runs on the base model
        # The adapter the backend decodes with; unknown at first (an engine before this one may have left one set).
        self.in_use: int | None = None if self.enabled else 0

    def use(self, lora: int) -> None:
        """Decode with adapter `lora` (0: none) from the next decode on."""
        if lora != self.in_use:
            self.in_use = lora
            self.backend.use_lora(lora)

    def check(self, lora: int) -> None:
        """ValueError unless a new request may run with adapter `lora` (0: none). Thread-safe."""
        loaded = self.loaded
        if lora and lora not in loaded:
            raise ValueError(f"LoRA adapter {lora} is not loaded (loaded: {sorted(loaded) or 'none'})")

    def load(self, path: str) -> int:
        """Load an adapter from a GGUF file; its index. FileNotFoundError if there is no such file; ValueError if
        it is not an adapter for this model, AdapterLimit if no index is left. On the engine's thread, between ticks."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No adapter found for {path}")
        index = self.backend.load_lora(path)
        if index > MAX_ADAPTER_INDEX:  # its tokens' keys would not fit a key's 32 token bits
            self.backend.unload_lora(index)
            raise AdapterLimit(f"this engine has loaded {MAX_ADAPTER_INDEX} LoRA adapters, the most it can (an "
                             "unloaded adapter's index is not reused): restart the server to load more")
        self.loaded = self.loaded | {index}
        return index

    def unload(self, index: int) -> None:
        """Take no new request for the adapter; free it once no request uses it. On the engine's thread."""
        self.check(index)
        self.loaded = self.loaded - {index}
        self.retiring.add(index)
        self.release(index)

    def release(self, lora: int) -> None:
        """A request of adapter `lora` ended (or none is left): free the adapter if it is unloaded and unused."""
        if lora in self.retiring and all(r.lora != lora for r in list(self.requests.values())):
            self.retiring.discard(lora)
            self.backend.unload_lora(lora)  # which unsets it if it was set
            self.in_use = 0 if self.in_use == lora else self.in_use
