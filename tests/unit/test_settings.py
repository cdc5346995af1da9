"""Settings beyond the command line (COBALI_* and --config FILE), API keys, CORS, and the warning for an open bind."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from cobali.config import settings
from cobali.config.serve_flags import server_config
from cobali.faces import cli
from cobali.http import serve as serve_module
from cobali.http.config import ServerConfig
from tests.unit.http.test_server_api import fake_app, fake_engine, wait_healthy


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No COBALI_* of the machine running the tests, nor VLLM_ALLOW_RUNTIME_LORA_UPDATING, leaks into them."""
    for name in [n for n in os.environ if n.upper().startswith("COBALI_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)


def parse(argv: list[str]) -> argparse.Namespace:
    return settings.parse_args(cli.build_parser(), argv)


def cli_error(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The CLI's error for `cobali serve ...`; a server that starts instead fails the test (it would serve on)."""

    def served(*_args) -> None:
        raise AssertionError(f"{argv} started a server: no error")

    monkeypatch.setattr(serve_module, "serve", served)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def write_config(path: Path, values: dict) -> Path:
    if path.suffix == ".json":
        path.write_text(json.dumps(values))
    elif path.suffix == ".toml":
        path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    else:  # YAML: JSON is YAML, but write it as a person would
        path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in values.items()))
    return path


def test_every_kind_of_flag_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"COBALI_MAX_SLOTS": "7", "COBALI_KV_UNIFIED": "true", "COBALI_NO_PREFIX_CACHE": "1",
                        "cobali_policy": "balanced", "COBALI_MAX_CHOICES": "3", "COBALI_PREPROCESS_TIMEOUT": "2.5",
                        "COBALI_ALLOWED_ORIGINS": "https://a.example http://b.example:8080",
                        "COBALI_ASYNC_SCHEDULING": "off", "COBALI_NO_COMPACT_SLOTS": "False"}.items():
        monkeypatch.setenv(name, value)
    args = parse(["serve"])
    assert (args.max_slots, args.kv_unified, args.prefix_cache, args.policy) == (7, True, False, "balanced")
    assert args.limit_max_choices == 3, "the key is the flag's name (--max-choices), not its dest"
    assert args.preprocess_timeout == 2.5
    assert (args.async_scheduling, args.compact_slots) == (False, True), "false, 0, no, off: the flag not given"
    assert args.allowed_origins == ["https://a.example", "http://b.example:8080"]
    monkeypatch.setenv("COBALI_MAX_SLOTS", "5")
    assert parse(["run", "--prompts", "x.txt"]).max_slots == 5, "every subcommand reads them"


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".toml", ".json"])
def test_every_kind_of_flag_comes_from_a_config_file(suffix: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path / f"cobali{suffix}", {
        "max_slots": 5, "kv_unified": True, "no_prefix_cache": True, "itl_target_ms": 12.5, "policy": "balanced",
        "allowed_origins": ["https://a.example"], "max-body-bytes": 1000, "api_key": ["k1", "k2"]})
    for args in (parse(["serve", "--config", str(path)]), parse(["serve", f"--conf={path}"])):
        assert (args.max_slots, args.kv_unified, args.prefix_cache, args.policy) == (5, True, False, "balanced")
        assert (args.itl_target_ms, args.max_body_bytes, args.allowed_origins) == (12.5, 1000, ["https://a.example"])
        assert server_config(args).api_keys == ("k1", "k2")
    monkeypatch.setenv("COBALI_CONFIG", str(path))
    assert parse(["serve"]).max_slots == 5, "COBALI_CONFIG names the file when --config does not"


def test_the_command_line_wins_then_the_environment_then_the_file(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path / "c.yaml", {"max_slots": 5, "host": "127.0.0.2", "api_key": "from-file"})
    file = ["serve", "--config", str(path)]
    assert (parse(["serve"]).max_slots, parse(file).max_slots, parse(file).host) == (16, 5, "127.0.0.2")
    monkeypatch.setenv("COBALI_MAX_SLOTS", "7")
    monkeypatch.setenv("COBALI_API_KEY", "from-env")
    assert (parse(file).max_slots, parse(file).host, server_config(parse(file)).api_keys) == (7, "127.0.0.2",
                                                                                             ("from-env",))
    given = parse([*file, "--max-slots", "9", "--api-key", "a", "--api-key", "b"])
    assert given.max_slots == 9
    assert server_config(given).api_keys == ("a", "b"), "keys on the command line replace the environment's"


def test_a_flag_the_parser_requires_may_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COBALI_INPUT", "in.jsonl")
    monkeypatch.setenv("COBALI_OUTPUT", "out.jsonl")
    args = parse(["run-batch"])
    assert (args.input, args.output) == ("in.jsonl", "out.jsonl")
    assert parse(["run-batch", "-i", "other.jsonl"]).input == "other.jsonl"


@pytest.mark.parametrize(("env", "values", "fragments"), [
    ({"COBALI_MAX_SLOTS": "lots"}, None, ["COBALI_MAX_SLOTS='lots'", "expected a positive integer"]),
    ({"COBALI_KV_UNIFIED": "maybe"}, None, ["COBALI_KV_UNIFIED='maybe'", "expected true or false"]),
    ({"COBALI_POLICY": "fastest"}, None, ["COBALI_POLICY='fastest'", "invalid choice 'fastest'"]),
    ({"COBALI_ALLOWED_ORIGINS": "https://a.example/"}, None, ["COBALI_ALLOWED_ORIGINS", "'https://a.example/'"]),
    ({}, {"max_slots": 0}, ["max_slots = 0", "--max-slots", "expected a positive integer, got 0"]),
    ({}, {"queue": "lifo"}, ["queue = 'lifo'", "invalid choice 'lifo'"]),
    ({}, {"max_slots": [1, 2]}, ["max_slots = [1, 2]", "expected one value"]),
    ({}, {"max_slotz": 4, "hots": "x", "port": 1}, ["unknown settings hots, max_slotz"]),
    ({}, {"config": "other.yaml"}, ["unknown settings config"]),
])
def test_a_bad_value_names_its_variable_or_key_and_the_value(env: dict, values: dict | None, fragments: list[str],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["serve"] if values is None else ["serve", "--config", str(write_config(tmp_path / "c.toml", values))]
    err = cli_error(argv, capsys, monkeypatch)
    for fragment in fragments:
        assert fragment in err, err
    if values is not None:
        assert str(tmp_path / "c.toml") in err, "the file is named"


@pytest.mark.parametrize(("name", "text", "fragment"), [
    ("missing.yaml", None, "missing.yaml: no such file"),
    ("c.ini", "max_slots=4", "must end in .yaml, .yml, .toml or .json"),
    ("c.yaml", "max_slots: [4", "c.yaml: cannot read it"),
    ("c.toml", "max_slots = ", "c.toml: cannot read it"),
    ("c.json", "[4]", "c.json: cannot read it"),
])
def test_a_config_file_that_cannot_be_read_is_named(name: str, text: str | None, fragment: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if text is not None:
        (tmp_path / name).write_text(text)
    assert fragment in cli_error(["serve", "--config", str(tmp_path / name)], capsys, monkeypatch)


def test_help_says_it_once_and_works_whatever_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COBALI_MAX_SLOTS", "lots")  # broken settings must not hide the help that explains them
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("COBALI_MAX_SLOTS=16") == 1 and "--config FILE" in out


def test_vllms_runtime_lora_variable_still_sets_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not parse(["serve"]).allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert parse(["serve"]).allow_runtime_lora_updating
    monkeypatch.setenv("COBALI_ALLOW_RUNTIME_LORA_UPDATING", "false")
    assert not parse(["serve"]).allow_runtime_lora_updating, "cobali's own variable is the more specific"


# ---- API keys ---------------------------------------------------------------------------------------------


def test_api_keys_come_from_a_file_and_from_the_flag(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nalpha\n\n  beta  \n# gamma\n")
    args = parse(["serve", "--api-key-file", str(keys), "--api-key", "delta", "--api-key", "alpha"])
    assert server_config(args).api_keys == ("delta", "alpha", "beta")


@pytest.mark.parametrize(("text", "fragment"), [
    (None, "cannot read the API key file"),
    ("# only a comment\n\n", "holds no key"),
    (b"\xff\xfe", "cannot read the API key file"),
])
def test_an_api_key_file_without_keys_is_named(text: str | bytes | None, fragment: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    err = cli_error(["serve", "--api-key-file", str(path)], capsys, monkeypatch)
    assert fragment in err and str(path) in err


def test_any_of_several_keys_is_accepted() -> None:
    with TestClient(fake_app(fake_engine(), "m", api_keys=("alpha", "beta"))) as client:
        wait_healthy(client)
        for key, status in (("alpha", 200), ("beta", 200), ("gamma", 401), ("alph", 401), ("", 401)):
            assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == status, key
            assert client.get("/docs", headers={"Authorization": f"Bearer {key}"}).status_code == status, key


# ---- CORS -------------------------------------------------------------------------------------------------

ALLOWED = "https://app.example.com"


def preflight(client: TestClient, origin: str) -> httpx.Response:
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang"})


def test_a_cors_preflight_lets_in_an_allowed_origin_only() -> None:
    with TestClient(fake_app(fake_engine(), "m", api_keys=("k",), allowed_origins=(ALLOWED,))) as client:
        wait_healthy(client)
        allowed = preflight(client, ALLOWED)
        assert allowed.status_code == 200, "the preflight carries no key, and needs none"
        assert allowed.headers["access-control-allow-origin"] == ALLOWED
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= set(allowed.headers["access-control-allow-headers"].split(", "))
        refused = preflight(client, "https://evil.example")
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        simple = client.get("/v1/models", headers={"Origin": ALLOWED, "Authorization": "Bearer k"})
        assert simple.status_code == 200 and simple.headers["access-control-allow-origin"] == ALLOWED


def test_without_allowed_origins_no_cors_header_is_sent() -> None:
    with TestClient(fake_app(fake_engine(), "m")) as client:
        wait_healthy(client)
        for response in (preflight(client, ALLOWED), client.get("/v1/models", headers={"Origin": ALLOWED})):
            assert not any(name.startswith("access-control-") for name in response.headers), response.headers


def test_the_flags_reach_the_app_that_serve_builds() -> None:
    """From the command line to the app: keys and origins through server_config and build_app (not run: no engine)."""
    from cobali.config.flags import engine_setup

    args = parse(["serve", "--model", "/nonexistent/m.gguf", "--api-key", "a", "--allowed-origins", ALLOWED])
    client = TestClient(serve_module.build_app(engine_setup(args), server_config(args)))  # no lifespan: no model
    assert client.get("/v1/models", headers={"Authorization": "Bearer b"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer a"}).status_code == 200
    assert preflight(client, ALLOWED).headers["access-control-allow-origin"] == ALLOWED


# ---- binding beyond loopback ------------------------------------------------------------------------------


def served_log(settings_: ServerConfig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> str:
    """What `serve` logs before it binds: uvicorn is not run, the app is a fake one."""
    monkeypatch.setattr(serve_module, "build_app", lambda _spec, _server: fake_app(fake_engine(), "m"))
    monkeypatch.setattr(serve_module.DrainingServer, "run", lambda _self: None)
    monkeypatch.setattr(serve_module.signal, "signal", lambda *_args: None)
    caplog.clear()
    with caplog.at_level(logging.INFO, "cobali.http"):
        assert serve_module.serve(None, settings_) == 0  # type: ignore[arg-type]
    return "\n".join(f"{r.levelname} {r.getMessage()}" for r in caplog.records)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_without_a_key_is_quiet(host: str, monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    assert "WARNING" not in served_log(ServerConfig(host=host), monkeypatch, caplog)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "my-host.example"])
def test_beyond_loopback_without_a_key_warns_loudly(host: str, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    logged = served_log(ServerConfig(host=host, port=8123), monkeypatch, caplog)
    assert f"WARNING NO API KEY: bound to {host}, anyone who can reach port 8123 can use this server" in logged
    assert "--api-key-file" in logged
    assert "WARNING" not in served_log(ServerConfig(host=host, api_keys=("k",)), monkeypatch, caplog)



@pytest.mark.parametrize(("value", "expected"), [("true", True), ("off", False)])
def test_a_flag_with_a_no_form_comes_from_the_environment(value: str, expected: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--two-pass-ticks / --no-two-pass-ticks (argparse's BooleanOptionalAction, whose const is None)."""
    monkeypatch.setenv("COBALI_TWO_PASS_TICKS", value)
    assert parse(["serve"]).two_pass_ticks is expected
