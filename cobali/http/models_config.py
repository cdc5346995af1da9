"""The typed config of a server of many models (`cobali serve --models ...`, --models-dir, --models-preset),
built once at the CLI edge (cobali/config/model_flags.py): the router (cobali/http/model_router.py) serves it."""

from __future__ import annotations

from dataclasses import dataclass

from cobali.frontend.interface import EngineSetup
from cobali.frontend.model_table import ModelEntry, ModelPolicy
from cobali.http.config import ServerConfig


@dataclass(frozen=True)
class ServedModel:
    """One model as the operator declared it: what the table weighs it by, and how its engine and its own server
    (in a process of its own) are made."""

    entry: ModelEntry  # its name, estimated bytes, pin and keep-alive
    setup: EngineSetup  # its engine's flags (context, slots, KV types, LoRA, ...)
    server: ServerConfig  # its own template, parsers, LoRA names and request limits; served_model_name = entry.name

    def __post_init__(self) -> None:
        if self.server.served_model_name != self.entry.name:
            raise ValueError(f"model {self.entry.name!r}: its server serves it as {self.server.served_model_name!r}")


@dataclass(frozen=True)
class ModelsConfig:
    """The endpoint, its models and the policy that loads and evicts them."""

    front: ServerConfig  # the endpoint's: host, port, keys, connection caps, CORS, TLS, body limit
    models: tuple[ServedModel, ...]  # in declaration order; names unique
    policy: ModelPolicy

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("no model declared: give --models NAME=PATH, --models-dir DIR or --models-preset FILE")
        names = [model.entry.name for model in self.models]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"models declared twice: {', '.join(twice)} (a request's `model` must name one)")
