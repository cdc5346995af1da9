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
