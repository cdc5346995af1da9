"""Every flag of every subcommand also from the environment and from a config file, read with pydantic-settings.

    COBALI_MAX_SLOTS=16 cobali serve            # a flag's name, upper case, after COBALI_
    cobali serve --config cobali.yaml           # max_slots: 16 (YAML, TOML or JSON); or COBALI_CONFIG=cobali.yaml

The command line wins, then the environment, then the file, then the flag's default. A value from the environment
or a file goes through the flag's own argparse `type` and `choices`, so it is checked as the flag is, and an error
names the variable or key and the value. Done once here, at the CLI's edge: the faces see one Namespace.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "COBALI_"
CONFIG_ENV = "COBALI_CONFIG"
EPILOG = ("Each flag may also come from the environment as COBALI_<FLAG> (COBALI_MAX_SLOTS=16 for --max-slots 16), "
          "or from --config FILE as a key (YAML, TOML or JSON: max_slots: 16). The command line wins over the "
          "environment, and the environment over the file.")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


class _Unset(list):
    """A flag's default while the environment or the file holds its value: still this object after parsing means
    the command line did not give it. A list, so that an `append` flag given on the command line starts afresh
    (argparse copies its default and appends to the copy) instead of adding to the environment's values."""


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--config and the epilog on every subcommand, nested ones (`bench serve`) included."""
    for command in _subcommands(parser):
        command.add_argument("--config", metavar="FILE", default=None,
                             help=f"settings: YAML, TOML or JSON, a flag's name as its key (default ${CONFIG_ENV})")
        command.epilog = f"{command.epilog}\n\n{EPILOG}" if command.epilog else EPILOG
        add_config_flags(command)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """parser.parse_args, with the flags the command line leaves out taken from the environment or the file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chain = _chain(parser, argv)
    if not chain or any(token in ("-h", "--help") for token in argv):  # help shows the built-in defaults
        return parser.parse_args(argv)
    command, flags = chain[-1], _flags(chain)
    try:
        found = _read(flags, _config_path(command.prog, argv))
        values = {key: convert_setting(flags[key], value, origin) for key, (value, origin) in found.items()}
    except ValueError as err:
        command.error(str(err))
    pending: dict[str, tuple[_Unset, Any]] = {}
    for key, value in values.items():
        action = flags[key]
        action.default, action.required = _Unset(), False
        pending[action.dest] = (action.default, value)
    args = parser.parse_args(argv)
    for dest, (unset, value) in pending.items():
        given = getattr(args, dest)
        setattr(args, dest, value if given is unset else list(given) if isinstance(given, _Unset) else given)
    return args


def _subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    nested = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    return list(dict.fromkeys(nested[0].choices.values())) if nested else []  # aliases name one parser twice


def _chain(parser: argparse.ArgumentParser, argv: list[str]) -> list[argparse.ArgumentParser]:
    """The subcommand's parsers, outermost first (`bench`, then `bench serve`): the first word each knows."""
    chain: list[argparse.ArgumentParser] = []
    while nested := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        at = next((i for i, token in enumerate(argv) if token in nested[0].choices), None)
        if at is None:
            break
        parser, argv = nested[0].choices[argv[at]], argv[at + 1:]
        chain.append(parser)
    return chain


def _flags(chain: list[argparse.ArgumentParser]) -> dict[str, argparse.Action]:
    """Each flag by its settings key: its first long name without the dashes, `-` as `_` (--max-slots: max_slots).
    The flag's name, not its dest, since that is what --help shows (--max-choices keeps limit_max_choices)."""
    flags: dict[str, argparse.Action] = {}
    for parser in chain:  # a nested subcommand's flag wins over its parent's of the same name
        for action in parser._actions:
            long = [name for name in action.option_strings if name.startswith("--")]
            if long and not isinstance(action, _SKIP) and action.dest != "config":
                flags[long[0][2:].replace("-", "_")] = action
    return flags


def _config_path(prog: str, argv: list[str]) -> str | None:
    """--config as argparse will read it (abbreviated, or with =), before the real parse needs the file's values."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False)  # a bare --config is the command's error
    pre.add_argument("--config", default=None)
    return pre.parse_known_args(argv)[0].config or os.environ.get(CONFIG_ENV) or None


def _read(flags: dict[str, argparse.Action], path: str | None) -> dict[str, tuple[Any, str]]:
    """The values found, by key, with where each came from; the environment's over the file's."""
    from pydantic import create_model
    from pydantic_settings import BaseSettings, EnvSettingsSource

    # Typed as Any: create_model's other keywords (__doc__, __config__...) would each be checked against a field.
    fields: dict[str, Any] = {key: (Any, None) for key in flags}
    with warnings.catch_warnings():  # never instantiated: a key named like a BaseModel method (json) is harmless
        warnings.simplefilter("ignore")
        model = create_model("CobaliSettings", __base__=BaseSettings, **fields)
    found = {key: (value, f"{path}: {key} = {value!r}") for key, value in _read_file(model, path, flags).items()}
    env = EnvSettingsSource(model, env_prefix=ENV_PREFIX, case_sensitive=False, env_ignore_empty=True)()
    found.update({key: (value, f"{ENV_PREFIX}{key.upper()}={value!r}") for key, value in env.items()})
    return found


def _read_file(model: type, path: str | None, flags: dict[str, argparse.Action]) -> dict[str, Any]:
    if path is None:
        return {}
    from pydantic_settings import JsonConfigSettingsSource, TomlConfigSettingsSource, YamlConfigSettingsSource

    suffix = Path(path).suffix.lower()
    sources = {".yaml": (YamlConfigSettingsSource, "yaml_file"), ".yml": (YamlConfigSettingsSource, "yaml_file"),
               ".toml": (TomlConfigSettingsSource, "toml_file"), ".json": (JsonConfigSettingsSource, "json_file")}
    if suffix not in sources:
        raise ValueError(f"config file {path}: its name must end in .yaml, .yml, .toml or .json")
    if not Path(path).is_file():  # the sources read a missing file as an empty one
        raise ValueError(f"config file {path}: no such file")
    source, argument = sources[suffix]
    try:
        data = source(model, **{argument: path})()
    except ImportError:  # tomllib: Python 3.11+
        raise ValueError(f"config file {path}: TOML needs Python 3.11 or later; use YAML or JSON") from None
    except Exception as err:  # each format's own parse error (yaml.YAMLError is no ValueError), a top level no mapping
        raise ValueError(f"config file {path}: cannot read it: {err}") from None
    data = {str(key).replace("-", "_"): value for key, value in data.items()}  # max-slots as well as max_slots
    if unknown := sorted(set(data) - set(flags)):
        raise ValueError(f"config file {path}: unknown settings {', '.join(unknown)} (a key is a flag's name "
                         "without its dashes, _ for -: max_slots for --max-slots)")
    return data


def convert_setting(action: argparse.Action, raw: Any, origin: str) -> Any:
    """The value the flag would give, through its own type and choices; ValueError naming `origin` if bad."""
    where = f"{origin} (for {'/'.join(action.option_strings)})"
    if action.nargs == 0:  # store_true, store_false: a boolean
        on = _boolean(raw, where)
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: its const is None
            return on
        if isinstance(action.const, bool):
            return action.const if on else not action.const
        return action.const if on else action.default
    many = action.nargs not in (None, "?")
    if isinstance(raw, list):
        if not (many or isinstance(action, argparse._AppendAction)):
            raise ValueError(f"{where}: expected one value, got a list")
        items = raw  # [] too: a file may say "none", which the command line cannot
    elif many and isinstance(raw, str):  # several values in one string split as the command line would
        try:
            items = shlex.split(raw)
        except ValueError as err:  # an unclosed quote
            raise ValueError(f"{where}: {err}") from None
    else:
        items = [raw]
    values = [_one(action, _text(item), where) for item in items]
    return values if many or isinstance(action, argparse._AppendAction) else values[0]


def _one(action: argparse.Action, text: str, where: str) -> Any:
    try:
        value = action.type(text) if callable(action.type) else text
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{where}: {err}") from None
    except (TypeError, ValueError):
        raise ValueError(f"{where}: invalid value {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
    return value


def _text(item: Any) -> str:
    """A file's typed value as the command line would spell it (YAML's 16 is '16', true is 'true')."""
    return str(item).lower() if isinstance(item, bool) else str(item)


def _boolean(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{where}: expected true or false (1 or 0), got {raw!r}")
