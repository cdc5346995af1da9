"""What every route needs, hung on app.state.server."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

from cobali.frontend.client import EngineClient
from cobali.frontend.errors import unknown_model
from cobali.frontend.inputs import InputProcessor
from cobali.frontend.work_pool import WorkPool
from cobali.http.config import ServerConfig
from cobali.http.prometheus import ServerMetrics


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
    config: ServerConfig  # its served_model_name set: the model's own name when the flag left it out
    client: EngineClient
    metrics: ServerMetrics
    pool: WorkPool  # tokenizing, templates, grammars: off the event loop
    loras: LoraNames = field(default_factory=LoraNames)
    created: int = 0  # unix time the server started, for /v1/models

    @property
    def model_name(self) -> str:
        assert self.config.served_model_name is not None, "create_app is given the name"
        return self.config.served_model_name

    def inputs(self) -> InputProcessor:
        """How requests to this server's model are prepared; EngineUnavailable (a 503) unless requests are taken
        (the engine loaded, or restarting after a crash; not failed, not draining)."""
        self.client.require_accepting()
        return self._inputs

    @functools.cached_property  # once the model has loaded (inputs() checks first)
    def _inputs(self) -> InputProcessor:
        client = self.client
        config = self.config
        return InputProcessor(client.model_info, client.tokenizer, client.grammars, config.chat_template,
                              config.reasoning_parser, config.tool_call_parser)

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
        return model if model is not None and model in self.loras else self.model_name
