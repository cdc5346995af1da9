"""What every route needs, hung on app.state.server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from cobali.server.engine_thread import EngineThread
from cobali.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerContext:
    engine_thread: EngineThread
    metrics: ServerMetrics
    model_name: str
    api_key: str | None = None
    created: int = 0  # unix time the server started, for /v1/models
    chat_template: str | None = None  # --chat-template: Jinja text used instead of the model's own
    embedding_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one embeddings call at a time
    lora_names: tuple[str, ...] = ()  # --lora-modules: model ids served with LoRA adapters 1, 2, ...

    def serves(self, model: str | None) -> bool:
        """A request may name the base model, one of its adapters, or none."""
        return model is None or model == self.model_name or model in self.lora_names

    def lora_of(self, model: str | None) -> int:
        """The adapter a model id runs with: 0 for the base model."""
        return self.lora_names.index(model) + 1 if model in self.lora_names else 0

    def model_id(self, model: str | None) -> str:
        """The model id replies name: the adapter asked for, else the base model."""
        return model if model in self.lora_names else self.model_name
