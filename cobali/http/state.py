"""What every route needs, hung on app.state.server."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from cobali.frontend.client import EngineThread
from cobali.frontend.errors import unknown_model
from cobali.frontend.request_limits import PreprocessLimits, RequestLimits
from cobali.frontend.work_pool import WorkPool
from cobali.http.config import DEFAULT_MAX_STREAM_BUFFER_CHARS, DEFAULT_SEND_TIMEOUT_S
from cobali.http.prometheus import ServerMetrics
from cobali.structured.limits import GrammarLimits


class LoraNames:
    """Model ids served with LoRA adapters, and their engine adapter indices. Read and written on the event
    loop only; a name being loaded is reserved, so two loads of one name cannot both go ahead."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.index: dict[str, int] = {name: i for i, name in enumerate(names, 1)}  # --lora-modules: 1, 2, ...
        self.reserved: set[str] = set()

    def name_when_loaded(self, name: str, loading: asyncio.Future) -> None:
        """Reserve `name` while its adapter loads, then give it the adapter's index if the load succeeded. Done
        when the load ends, not by the handler that waits for it: one cancelled meanwhile (its client gone)
        must not leave an adapter loaded with no name."""
        self.reserved.add(name)
        loading.add_done_callback(functools.partial(self._loaded, name))

    def _loaded(self, name: str, loading: asyncio.Future) -> None:
        self.reserved.discard(name)
        if not loading.cancelled() and loading.exception() is None:
            self.index[name] = loading.result()

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def names(self) -> tuple[str, ...]:
        return tuple(self.index)


@dataclass(frozen=True)
class ServerContext:
    engine_thread: EngineThread
    metrics: ServerMetrics
    model_name: str
    api_keys: tuple[str, ...] = ()  # a request must bear one of them; none: the API is open
    created: int = 0  # unix time the server started, for /v1/models
    chat_template: str | None = None  # --chat-template: Jinja text used instead of the model's own
    embedding_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one embeddings call at a time
    loras: LoraNames = field(default_factory=LoraNames)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # what one constraint may cost
    pool: WorkPool = field(default_factory=lambda: WorkPool(PreprocessLimits()))  # tokenizing, templates, grammars
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S  # a stream whose client reads nothing that long is dropped
    max_stream_buffer_chars: int = DEFAULT_MAX_STREAM_BUFFER_CHARS  # text a stream may fall behind by

    def serves(self, model: str | None) -> bool:
        """A request may name the base model, one of its adapters, or none."""
        return model is None or model == self.model_name or model in self.loras

    def lora_of(self, model: str | None) -> int:
        """The adapter a model id runs with: 0 for the base model. A 404 for a model not served (any more: an
        adapter may be unloaded while its request was being read)."""
        if not self.serves(model):
            raise unknown_model(str(model), self.model_name)
        return self.loras.index.get(model, 0) if model is not None else 0

    def model_id(self, model: str | None) -> str:
        """The model id replies name: the adapter asked for, else the base model."""
        return model if model in self.loras else self.model_name
