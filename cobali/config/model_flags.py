"""`cobali serve`'s flags for many models behind one endpoint, and the ModelsConfig built from them once, here.

    cobali serve --models chat=chat.gguf coder=coder.gguf     # each NAME=PATH a model, named NAME in the API
    cobali serve --models-dir /models                         # every model in a folder, named by its file or folder
    cobali serve --models-preset models.yaml                  # models: {chat: {model: chat.gguf, ctx: 8192}}

Each model's engine is built from a copy of the serve flags with its path as --model and its preset's settings
over them: the same checks, the same defaults. The endpoint's own settings (address, keys, connection caps, CORS,
TLS, body limit) are the front door's, the router's; a model's engine runs in a process of its own.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cobali.backends.gguf_memory import SPLIT_NAME, estimate_model_bytes
from cobali.backends.memory import fit_margin, fmt_bytes, gpu_present, host_available
from cobali.config.flags import (
    add_engine_args,
    engine_setup,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from cobali.config.serve_flags import _add_model_args, server_config
from cobali.config.settings import _flags, convert_setting

if TYPE_CHECKING:
    from cobali.http.models_config import ModelsConfig, ServedModel

# The model table, and the config that holds its entries, import FastAPI: they are imported where a server of many
# models is built, not with the flags (`cobali run` builds its parser with this module too).

log = logging.getLogger("cobali.models")

# A preset's keys beside the per-model flags: the model's file, and its place in the load/evict policy.
PRESET_KEYS = ("model", "pinned", "keep_alive")
# Flags a preset may not set per model: the model's name is its key, its file the `model` key.
NOT_PER_MODEL = frozenset({"served_model_name", "model", "hf_repo", "hf_file"})
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?))?(b?)", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


@dataclasses.dataclass(frozen=True)
class PresetModel:
    """A declared model: its name, its file, and a preset's settings for it (through their flags' types)."""

    name: str
    path: str
    settings: Mapping[str, Any]  # by the flag's dest (as the Namespace holds it)
    pinned: bool = False
    keep_alive_s: float | None = None


def memory_size(text: str) -> int:
    """Bytes: a number, or with a unit: KiB/MiB/GiB/TiB and K/M/G/T are powers of 1024 (as Docker reads 8G),
    KB/MB/GB/TB powers of 1000."""
    found = _SIZE.fullmatch(text.strip())
    if found is None or (found[3] and not found[2]):
        raise argparse.ArgumentTypeError(f"expected a size such as 8GiB, 512MiB, 8G, 1.5GB or bytes, got {text!r}")
    number, prefix, binary, unit_b = found.groups()
    base = 1000 if prefix and unit_b and not binary else 1024
    size = int(float(number) * base ** _POWERS.get((prefix or "").lower(), 0))
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least one byte, got {text!r}")
    return size


def _duration(text: str) -> float:
    from cobali.frontend.model_table import keep_alive_seconds

    try:
        return keep_alive_seconds(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _model_spec(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not (sep and name.strip() and path):
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"{name}: no such model file {path!r}")
    return name, path


def _ggufs(folder: Path) -> list[Path]:
    """The .gguf files directly in `folder`, but a multimodal projector's (mmproj*), which is no model."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".gguf"
                  and not p.name.lower().startswith("mmproj"))


def _first_shard(path: Path) -> bool | None:
    """None for a whole model's file; else whether it is its split's first shard (the one llama.cpp is given)."""
    split = SPLIT_NAME.search(path.name)
    return None if split is None else int(split[1]) == 1


def _folder_model(folder: Path, files: list[Path]) -> Path:
    candidates = [p for p in files if _first_shard(p) is not False]
    if len(candidates) != 1:
        raise argparse.ArgumentTypeError(
            f"{str(folder)!r} holds {len(candidates)} models ({', '.join(p.name for p in candidates)}): a folder is "
            "one model, its only .gguf or its split's first shard (*-00001-of-*.gguf); put each model in its own")
    return candidates[0]


def models_dir(text: str) -> tuple[tuple[str, str], ...]:
    """The models of a folder, as (name, path): a .gguf in it is one, named by its file's stem (a split's by the
    name before -00001-of-); a subfolder holding .gguf files is one, named by the subfolder."""
    root = Path(text)
    if not root.is_dir():
        raise argparse.ArgumentTypeError(f"no such directory {text!r}")
    found = [(p.name[:split.start()] if (split := SPLIT_NAME.search(p.name)) else p.stem, str(p))
             for p in _ggufs(root) if _first_shard(p) is not False]
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if files := _ggufs(folder):
            found.append((folder.name, str(_folder_model(folder, files))))
    if not found:
        raise argparse.ArgumentTypeError(f"{text!r} holds no model: no .gguf file in it or in a folder of it "
                                         "(mmproj* files are projectors, not models)")
    return tuple(found)


def per_model_flags() -> dict[str, argparse.Action]:
    """The flags one model of many may set for itself, by settings key: the engine's and the model's."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    _add_model_args(parser)
    return {key: action for key, action in _flags([parser]).items() if key not in NOT_PER_MODEL}


def models_preset(path: str) -> tuple[PresetModel, ...]:
    """A --models-preset file's models, each value through its flag's own type (ValueError naming the file, the
    model, the key and the value)."""
    data = _read_preset(path)
    if set(data) != {"models"} or not isinstance(data["models"], dict) or not data["models"]:
        raise argparse.ArgumentTypeError(f"{path}: expected one key, models, mapping each model's name to its "
                                         f"settings (models: {{chat: {{model: chat.gguf}}}}); got keys {sorted(data)}")
    flags = per_model_flags()
    try:
        return tuple(_preset_model(path, str(name), entry, flags) for name, entry in data["models"].items())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _read_preset(path: str) -> dict[str, Any]:
    """The file as --config's are read (pydantic-settings' sources): YAML, TOML or JSON by its suffix."""
    import pydantic_settings as ps

    class Preset(ps.BaseSettings):  # what the sources read a file for: never instantiated
        models: Any = None

    sources = {".yaml": (ps.YamlConfigSettingsSource, "yaml_file"), ".yml": (ps.YamlConfigSettingsSource, "yaml_file"),
               ".toml": (ps.TomlConfigSettingsSource, "toml_file"), ".json": (ps.JsonConfigSettingsSource, "json_file")}
    if (kind := sources.get(Path(path).suffix.lower())) is None:
        raise argparse.ArgumentTypeError(f"{path}: a preset's name must end in .yaml, .yml, .toml or .json")
    if not Path(path).is_file():  # the sources read a missing file as an empty one
        raise argparse.ArgumentTypeError(f"no such file {path!r}")
    try:
        return dict(kind[0](Preset, **{kind[1]: path})())
    except Exception as err:  # each format's own parse error (yaml.YAMLError is no ValueError)
        raise argparse.ArgumentTypeError(f"{path}: cannot read it: {err}") from None


def _preset_model(path: str, name: str, entry: Any, flags: Mapping[str, argparse.Action]) -> PresetModel:
    from cobali.frontend.model_table import keep_alive_seconds

    where = f"{path}: model {name!r}"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a mapping of its settings, got {entry!r}")
    entry = {str(key).replace("-", "_"): value for key, value in entry.items()}
    if unknown := sorted(set(entry) - set(flags) - set(PRESET_KEYS)):
        raise ValueError(f"{where}: {', '.join(unknown)}: not a per-model setting (one of {', '.join(PRESET_KEYS)}, "
                         "or an engine or model flag's name without its dashes: max_slots, ctx, chat_template...)")
    model = entry.get("model")
    if not isinstance(model, str) or not Path(model).is_file():
        raise ValueError(f"{where}: model = {model!r}: expected the path of its GGUF file")
    pinned = entry.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"{where}: pinned = {pinned!r}: expected true or false")
    keep_alive = entry.get("keep_alive")
    try:
        keep_alive_s = None if keep_alive is None else keep_alive_seconds(keep_alive)
    except ValueError as err:
        raise ValueError(f"{where}: keep_alive = {keep_alive!r}: {err}") from None
    settings = {flags[key].dest: convert_setting(flags[key], value, f"{where}: {key} = {value!r}")
                for key, value in entry.items() if key not in PRESET_KEYS}
    return PresetModel(name, model, settings, pinned, keep_alive_s)


def add_models_args(parser: argparse.ArgumentParser) -> None:
    """serve's flags for many models, in a group of their own in its --help."""
    group = parser.add_argument_group(
        "many models", "Serve several models behind one endpoint: a request's `model` picks one, loaded on demand, "
        "in an engine process of its own; idle models are unloaded after a while, or to make room for another. "
        "--models, --models-dir and --models-preset declare them (together too); --model serves one model alone. "
        "The engine and model flags above are every model's defaults; a preset sets them per model.")
    group.add_argument("--models", type=_model_spec, nargs="+", action="extend", default=[], metavar="NAME=PATH",
                       help="models by name: the GGUF at PATH served as model NAME (several, and repeatable)")
    group.add_argument("--models-dir", type=models_dir, default=None, metavar="DIR",
                       help="every model in DIR: a .gguf file in it is one, named by the file's name without .gguf; "
                            "a folder in it holding .gguf files is one, named by the folder (its only .gguf, or a "
                            "split model's first shard *-00001-of-*.gguf); mmproj* files (projectors) are skipped")
    group.add_argument("--models-preset", type=models_preset, default=None, metavar="FILE",
                       help="models with settings of their own: YAML, TOML or JSON, as --config, holding "
                            "models: {NAME: {model: PATH, KEY: VALUE...}}, a KEY being an engine or model flag's name "
                            "without its dashes (max_slots: 4, ctx: 8192, cache_type_k: q8_0, chat_template: FILE, "
                            "lora_modules: [a=PATH], reasoning_parser: ...), pinned: true, or keep_alive: 10m; "
                            "relative paths are from the current directory")
    group.add_argument("--models-memory", type=memory_size, default=None, metavar="SIZE",
                       help="what loaded models may take together, each as estimated before it loads (weights, KV, "
                            "output and compute buffers): 8GiB, 512MiB, 8G, 1.5GB or bytes; the least recently used "
                            "are unloaded to make room. Default: the memory available at start (RAM and free swap, "
                            "under a cgroup's limit) less a margin. On a GPU, with layers offloaded "
                            "(--n-gpu-layers), the default is still the RAM's: set the GPU memory the models may take")
    group.add_argument("--models-max", type=non_negative_int, default=4, metavar="N",
                       help="models loaded at once (default %(default)s; 0: as many as --models-memory holds)")
    group.add_argument("--models-pin", nargs="+", action="extend", default=[], metavar="NAME",
                       help="models loaded at start and never unloaded")
    group.add_argument("--models-keep-alive", type=_duration, default=300.0, metavar="DURATION",
                       help="idle time after which a model is unloaded: 30s, 5m, 1h30m, or seconds; -1: never; 0: at "
                            "once (default 5m). A preset's keep_alive sets a model's own, and a request's keep_alive "
                            "(as Ollama's) its model's until the next request says otherwise")
    group.add_argument("--models-min-resident", type=non_negative_float, default=10.0, metavar="S",
                       help="a loaded model stays at least S seconds, whatever others are asked for: requests that "
                            "alternate between models cannot make them load and unload in turn (default %(default)s)")
    group.add_argument("--models-loads-per-client", type=positive_int, default=6, metavar="N",
                       help="loads one client address may cause a minute; beyond it HTTP 429 (default %(default)s)")
    group.add_argument("--models-queue", type=non_negative_int, default=None, metavar="N",
                       help="requests that may wait for one model to load; beyond it HTTP 429 (default: --max-queue)")
    group.add_argument("--models-load-timeout", type=positive_float, default=300.0, metavar="S",
                       help="how long a request waits for its model to load and get room; beyond it HTTP 503 "
                            "(default %(default)s)")


def models_config(args: argparse.Namespace) -> ModelsConfig | None:
    """The models, their engines and the policy from serve's flags; None without --models, --models-dir and
    --models-preset (a server of one model). ValueError naming the flag, model or value at fault."""
    from cobali.frontend.model_table import ModelPolicy
    from cobali.http.models_config import ModelsConfig

    declared = [*(PresetModel(name, path, {}) for name, path in args.models),
                *(PresetModel(name, path, {}) for name, path in args.models_dir or ()), *(args.models_preset or ())]
    if not declared:
        return None
    for given, why in ((args.model or args.hf_repo, "--model and --hf-repo serve one model"),
                       (args.served_model_name, "--served-model-name names the one model of --model"),
                       (args.replicas > 1, "--replicas scales out one model")):
        if given:
            raise ValueError(f"{why}: not with --models, --models-dir or --models-preset, where each model is named")
    names = [model.name for model in declared]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise ValueError(f"models declared twice: {', '.join(twice)} (--models, --models-dir and --models-preset "
                         "together name each model once)")
    if unknown := [name for name in args.models_pin if name not in names]:
        raise ValueError(f"--models-pin: no model named {', '.join(unknown)} (declared: {', '.join(names)})")
    models = tuple(_served_model(args, model, model.pinned or model.name in args.models_pin) for model in declared)
    adapters = [(name, served.entry.name) for served in models for name, _ in served.server.lora_modules]
    for adapter, model in adapters:
        if adapter in names or [a for a, _ in adapters].count(adapter) > 1:
            raise ValueError(f"model {model!r}: its LoRA adapter {adapter!r} (--lora-modules) has the name of another "
                             "model or adapter: a request's `model` must name one")
    return ModelsConfig(front=server_config(args), models=models, policy=ModelPolicy(
        memory_bytes=args.models_memory or default_models_memory(models), max_loaded=args.models_max,
        keep_alive_s=args.models_keep_alive, min_resident_s=args.models_min_resident,
        loads_per_client=args.models_loads_per_client,
        max_waiting=args.max_queue if args.models_queue is None else args.models_queue,
        load_timeout_s=args.models_load_timeout))


def _served_model(args: argparse.Namespace, model: PresetModel, pinned: bool) -> ServedModel:
    """The model's engine and server: the flags' copy, with its file, its name and its preset's settings."""
    from cobali.frontend.model_table import ModelEntry
    from cobali.http.models_config import ServedModel

    own = copy.copy(args)
    own.model, own.served_model_name = model.path, model.name
    vars(own).update(model.settings)
    try:
        setup = engine_setup(own, record_ticks=False)  # a server runs for days: its ticks go to the metrics
        if setup.backend.fit:
            raise ValueError("--fit sizes a context to all the free memory, which the models share: give its --ctx")
        # The front door's settings are the router's; the model's engine is a process of its own.
        server = dataclasses.replace(server_config(own), engine_process=True, api_keys=(), max_connections=None,
                                     max_connections_per_client=None, allowed_origins=(), ssl_keyfile=None,
                                     ssl_certfile=None)
        size = estimate_model_bytes(setup.backend)
    except ValueError as err:
        raise ValueError(f"model {model.name!r}: {err}") from None
    return ServedModel(ModelEntry(model.name, size, pinned, model.keep_alive_s), setup, server)


def default_models_memory(models: tuple[ServedModel, ...]) -> int:
    """--models-memory's default: the memory available now, less what --fit would leave free."""
    available = host_available()
    if available is None:
        raise ValueError("--models-memory: this OS does not say how much memory is available: give the budget")
    budget = available - fit_margin(available)
    if budget <= 0:
        raise ValueError(f"--models-memory: only {fmt_bytes(available)} of memory is available: give the budget")
    if (gpu := gpu_present()) and any(served.setup.backend.n_gpu_layers != 0 for served in models):
        log.warning("--models-memory defaults to the RAM available (%s), but this machine has a GPU (%s) where "
                    "the models' layers go: set --models-memory to what its memory holds", fmt_bytes(budget), gpu)
    return budget
