"""serve's flags for many models -> ModelsConfig: each way to declare models (--models, --models-dir, a preset in
YAML, JSON or TOML with settings per model), the policy's flags, the sizes --models-memory reads, its default,
and every error naming what is wrong."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import pytest

from cobali.backends.gguf_memory import estimate_model_bytes
from cobali.backends.memory import fit_margin
from cobali.config import model_flags, settings
from cobali.config.model_flags import memory_size, models_config
from cobali.faces import cli
from cobali.frontend.model_table import ModelPolicy
from cobali.http.models_config import ModelsConfig
from tests.unit.backends.test_gguf_memory import write_gguf

GiB = 2**30


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.upper().startswith("COBALI_")]:
        monkeypatch.delenv(name)


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, str]:
    """Two small models, a chat template, a LoRA adapter (its path is all the flags check) and a non-GGUF."""
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    (tmp_path / "adapter.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    return {"a": write_gguf(tmp_path / "a.gguf", n_vocab=1000), "b": write_gguf(tmp_path / "b.gguf", n_vocab=2000),
            "template": str(tmp_path / "template.jinja"), "adapter": str(tmp_path / "adapter.gguf"),
            "text": str(tmp_path / "notes.txt"), "dir": str(tmp_path)}


def config(*argv: str) -> ModelsConfig | None:
    return models_config(settings.parse_args(cli.build_parser(), ["serve", "--models-memory", "8GiB", *argv]))


def error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What `cobali serve ...` says is wrong: a flag's own error (argparse's exit) or the config's."""
    try:
        config(*argv)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        return capsys.readouterr().err
    except ValueError as err:
        return str(err)
    raise AssertionError(f"{argv}: no error")


def by_name(models: ModelsConfig | None) -> dict:
    assert models is not None
    return {served.entry.name: served for served in models.models}


def test_without_models_flags_serve_serves_one_model() -> None:
    assert config() is None


def test_models_by_name_get_engines_of_their_own_behind_the_front_door(files: dict[str, str]) -> None:
    models = config("--models", f"a={files['a']}", f"org/b={files['b']}", "--models", f"c={files['a']}",
                    "--api-key", "k", "--max-connections", "9", "--ctx", "4096", "--max-slots", "4")
    assert models is not None and [m.entry.name for m in models.models] == ["a", "org/b", "c"]
    assert models.front.api_keys == ("k",) and models.front.max_connections == 9
    for served in models.models:
        assert served.setup.backend.model_path == {"a": files["a"], "org/b": files["b"], "c": files["a"]}[
            served.entry.name]
        assert (served.setup.backend.n_ctx, served.setup.engine.max_slots) == (4096, 4)  # the flags, every model's
        assert served.server.served_model_name == served.entry.name and served.server.engine_process
        assert (served.server.api_keys, served.server.max_connections, served.server.allowed_origins) == ((), None, ())
        assert served.entry.bytes == estimate_model_bytes(served.setup.backend) > os.path.getsize(files["a"])
        assert not served.entry.pinned and served.entry.keep_alive_s is None


def test_a_models_dir_holds_files_and_folders_of_one_model_each(tmp_path: Path) -> None:
    write_gguf(tmp_path / "small.gguf")
    write_gguf(tmp_path / "mmproj-small-f16.gguf")  # a projector, not a model
    (tmp_path / "readme.md").write_text("models")
    write_gguf(tmp_path / "top-00001-of-00002.gguf")
    write_gguf(tmp_path / "top-00002-of-00002.gguf")
    (tmp_path / "big").mkdir()
    first = write_gguf(tmp_path / "big" / "big-q4-00001-of-00002.gguf")
    second = write_gguf(tmp_path / "big" / "big-q4-00002-of-00002.gguf")
    write_gguf(tmp_path / "big" / "mmproj-big.gguf")
    (tmp_path / "vision").mkdir()
    vision = write_gguf(tmp_path / "vision" / "model-Q8_0.gguf")
    write_gguf(tmp_path / "vision" / "mmproj-model-f16.gguf")
    (tmp_path / "empty").mkdir()
    models = by_name(config("--models-dir", str(tmp_path)))
    assert {name: served.setup.backend.model_path for name, served in models.items()} == {
        "small": str(tmp_path / "small.gguf"), "top": str(tmp_path / "top-00001-of-00002.gguf"), "big": first,
        "vision": vision}
    whole = estimate_model_bytes(models["big"].setup.backend)
    assert whole == models["big"].entry.bytes and whole - os.path.getsize(second) == estimate_model_bytes(
        models["vision"].setup.backend) - os.path.getsize(vision) + os.path.getsize(first)  # both shards weighed


PRESET = {"models": {
    "chat": {"model": "A", "max_slots": 4, "ctx": 8192, "cache_type_k": "q8_0", "chat_template": "TEMPLATE",
             "reasoning_parser": "none", "lora_modules": ["terse=ADAPTER"], "max_choices": 2, "pinned": True,
             "keep_alive": "10m"},
    "coder": {"model": "B", "no-prefix-cache": True},
}}


def write_preset(path: Path, files: dict[str, str], preset: dict = PRESET) -> str:
    text = json.dumps(preset)
    for key, value in (("A", files["a"]), ("B", files["b"]), ("TEMPLATE", files["template"]),
                       ("ADAPTER", files["adapter"])):
        text = text.replace(f'"{key}"', json.dumps(value)).replace(f'={key}"', f'={value}"')
    if path.suffix == ".yaml":  # as a person writes it: block YAML
        data = json.loads(text)["models"]
        text = "models:\n" + "".join(f"  {name}:\n" + "".join(f"    {k}: {json.dumps(v)}\n" for k, v in entry.items())
                                     for name, entry in data.items())
    elif path.suffix == ".toml":
        data = json.loads(text)["models"]
        text = "".join(f"[models.{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items())
                       for name, entry in data.items())
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json", ".toml"])
def test_a_preset_sets_each_models_own_engine_and_server(suffix: str, files: dict[str, str], tmp_path: Path) -> None:
    preset = write_preset(tmp_path / f"preset{suffix}", files)
    models = by_name(config("--models-preset", preset, "--max-slots", "2", "--models", f"plain={files['a']}"))
    chat, coder, plain = models["chat"], models["coder"], models["plain"]
    assert (chat.setup.engine.max_slots, chat.setup.backend.n_seq_max, chat.setup.backend.n_ctx) == (4, 4, 8192)
    assert (chat.setup.backend.cache_type_k, chat.setup.backend.cache_type_v) == ("q8_0", "f16")
    assert chat.setup.backend.lora_paths == (files["adapter"],)
    assert chat.server.chat_template == "{{ messages }}" and chat.server.reasoning_parser == "none"
    assert chat.server.lora_modules == (("terse", files["adapter"]),) and chat.server.limits.max_choices == 2
    assert chat.entry.pinned and chat.entry.keep_alive_s == 600.0
    assert not coder.setup.engine.prefix_cache and coder.setup.engine.max_slots == 2  # the command line's
    assert not coder.entry.pinned and coder.entry.keep_alive_s is None
    assert plain.setup.engine.prefix_cache and plain.server.chat_template is None and plain.server.lora_modules == ()
    # The same file as plain's, weighed with its own context, slots and cache types.
    assert chat.entry.bytes == estimate_model_bytes(chat.setup.backend) != plain.entry.bytes


def test_the_policy_comes_from_its_flags(files: dict[str, str]) -> None:
    models = config("--models", f"a={files['a']}", f"b={files['b']}", "--models-pin", "b", "--models-max", "0",
                    "--models-keep-alive", "-1", "--models-min-resident", "2.5", "--models-loads-per-client", "3",
                    "--models-queue", "7", "--models-load-timeout", "30", "--models-memory", "1.5GB")
    assert models is not None and models.policy == ModelPolicy(
        memory_bytes=1_500_000_000, max_loaded=0, keep_alive_s=math.inf, min_resident_s=2.5, loads_per_client=3,
        max_waiting=7, load_timeout_s=30.0)
    assert [m.entry.pinned for m in models.models] == [False, True]
    defaults = config("--models", f"a={files['a']}", "--max-queue", "9")
    assert defaults is not None and defaults.policy == ModelPolicy(memory_bytes=8 * GiB, max_waiting=9)


@pytest.mark.parametrize(("text", "size"), [
    ("512MiB", 512 * 2**20), ("8GiB", 8 * GiB), ("8G", 8 * GiB), ("8g", 8 * GiB), ("1.5GB", 1_500_000_000),
    ("1.5 GiB", 3 * GiB // 2), ("64kb", 64_000), ("2K", 2048), ("1TiB", 2**40), ("12345", 12345), ("100B", 100)])
def test_a_memory_size_reads_binary_and_decimal_units(text: str, size: int) -> None:
    assert memory_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "8 XB", "-1", "0", "0.1", "1e9", "8iB", "8 GiBs", "eight"])
def test_a_bad_memory_size_is_named(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"got {text!r}"):
        memory_size(text)


def test_the_default_budget_is_the_memory_available_less_a_margin(
        files: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    args = settings.parse_args(cli.build_parser(), ["serve", "--models", f"a={files['a']}"])
    monkeypatch.setattr(model_flags, "host_available", lambda: 20 * GiB)
    monkeypatch.setattr(model_flags, "gpu_present", lambda: None)
    models = models_config(args)
    assert models is not None and models.policy.memory_bytes == 20 * GiB - fit_margin(20 * GiB) == 18 * GiB
    assert "GPU" not in caplog.text
    monkeypatch.setattr(model_flags, "gpu_present", lambda: "/dev/nvidia0")
    models_config(args)
    assert "set --models-memory" in caplog.text and "/dev/nvidia0" in caplog.text
    monkeypatch.setattr(model_flags, "host_available", lambda: None)
    with pytest.raises(ValueError, match="--models-memory: this OS does not say"):
        models_config(args)


def bad_presets(files: dict[str, str]) -> list[tuple[dict, list[str]]]:
    chat = {"model": files["a"]}
    return [
        ({"models": {"chat": {**chat, "max_slot": 4}}}, ["model 'chat'", "max_slot: not a per-model setting"]),
        ({"models": {"chat": {**chat, "served_model_name": "x"}}}, ["served_model_name: not a per-model setting"]),
        ({"models": {"chat": {**chat, "host": "0.0.0.0"}}}, ["model 'chat'", "host: not a per-model"]),
        ({"models": {"chat": {**chat, "max_slots": 0}}}, ["model 'chat'", "max_slots = 0", "expected a positive"]),
        ({"models": {"chat": {**chat, "cache_type_k": "q9"}}}, ["cache_type_k = 'q9'", "invalid choice 'q9'"]),
        ({"models": {"chat": {**chat, "lora_modules": ["x=/no/adapter"]}}}, ["lora_modules", "'/no/adapter'"]),
        ({"models": {"chat": {**chat, "pinned": "yes"}}}, ["model 'chat'", "pinned = 'yes'"]),
        ({"models": {"chat": {**chat, "keep_alive": "soon"}}}, ["model 'chat'", "keep_alive = 'soon'"]),
        ({"models": {"chat": {"ctx": 4096}}}, ["model 'chat'", "model = None", "path of its GGUF"]),
        ({"models": {"chat": {"model": "/no/model.gguf"}}}, ["model 'chat'", "'/no/model.gguf'"]),
        ({"models": {"chat": "a.gguf"}}, ["model 'chat'", "expected a mapping"]),
        ({"models": {}}, ["expected one key, models"]),
        ({"models": {"chat": chat}, "max_slots": 4}, ["expected one key, models", "max_slots"]),
    ]


def test_a_bad_preset_names_the_file_the_model_the_key_and_the_value(
        files: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for index, (preset, fragments) in enumerate(bad_presets(files)):
        path = tmp_path / f"bad{index}.yaml"
        path.write_text(json.dumps(preset))  # JSON is YAML
        message = error(["--models-preset", str(path)], capsys)
        assert str(path) in message and all(f in message for f in fragments), (preset, message)


@pytest.mark.parametrize(("argv", "fragments"), [
    (["--models", "a"], ["expected NAME=PATH, got 'a'"]),
    (["--models", "={A}"], ["expected NAME=PATH, got '=/"]),
    (["--models", "a=/no/such.gguf"], ["a: no such model file '/no/such.gguf'"]),
    (["--models", "a={TEXT}"], ["model 'a'", "notes.txt is not a GGUF file"]),
    (["--models", "a={A}", "b={B}", "a={B}"], ["models declared twice: a"]),
    (["--models", "a={A}", "--models-dir", "{DIR}"], ["models declared twice: a"]),
    (["--models", "a={A}", "--models-pin", "a", "c"], ["--models-pin: no model named c", "declared: a"]),
    (["--models", "a={A}", "--model", "{A}"], ["--model and --hf-repo serve one model"]),
    (["--models", "a={A}", "--served-model-name", "x"], ["--served-model-name"]),
    (["--models", "a={A}", "--replicas", "2"], ["--replicas"]),
    (["--models", "a={A}", "--fit"], ["model 'a'", "--fit"]),
    (["--models", "a={A}", "--lora-modules", "a={ADAPTER}"], ["model 'a'", "--lora-modules names must differ"]),
    (["--models", "a={A}", "b={B}", "--lora-modules", "x={ADAPTER}"], ["adapter 'x'", "another model or adapter"]),
    (["--models", "a={A}", "--models-memory", "8XB"], ["--models-memory", "'8XB'"]),
    (["--models", "a={A}", "--models-keep-alive", "soon"], ["--models-keep-alive", "'soon'"]),
    (["--models-dir", "/no/such/dir"], ["no such directory '/no/such/dir'"]),
    (["--models-preset", "{DIR}/preset.ini"], ["preset.ini", ".yaml, .yml, .toml or .json"]),
])
def test_a_bad_flag_is_named(argv: list[str], fragments: list[str], files: dict[str, str],
                             capsys: pytest.CaptureFixture[str]) -> None:
    names = {"A": files["a"], "B": files["b"], "TEXT": files["text"], "ADAPTER": files["adapter"], "DIR": files["dir"]}
    message = error([arg.format(**names) for arg in argv], capsys)
    assert all(fragment in message for fragment in fragments), message


def test_an_adapter_may_not_take_another_models_name(files: dict[str, str], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    chat = {"model": "A", "lora_modules": ["b=ADAPTER"]}
    preset = write_preset(tmp_path / "p.json", files, {"models": {"chat": chat}})
    message = error(["--models-preset", preset, "--models", f"b={files['b']}"], capsys)
    assert "model 'chat': its LoRA adapter 'b' (--lora-modules) has the name of another model" in message


def test_a_models_dir_without_models_or_with_two_in_a_folder_is_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    write_gguf(tmp_path / "empty" / "mmproj-f16.gguf")
    assert f"'{tmp_path / 'empty'}' holds no model" in error(["--models-dir", str(tmp_path / "empty")], capsys)
    (tmp_path / "two").mkdir()
    write_gguf(tmp_path / "two" / "q4.gguf")
    write_gguf(tmp_path / "two" / "q8.gguf")
    message = error(["--models-dir", str(tmp_path)], capsys)
    assert f"'{tmp_path / 'two'}' holds 2 models (q4.gguf, q8.gguf)" in message


def test_a_models_config_needs_a_model_and_unique_names(files: dict[str, str]) -> None:
    models = config("--models", f"a={files['a']}")
    assert models is not None
    with pytest.raises(ValueError, match="no model declared"):
        ModelsConfig(models.front, (), models.policy)
    with pytest.raises(ValueError, match="models declared twice: a"):
        ModelsConfig(models.front, models.models * 2, models.policy)
