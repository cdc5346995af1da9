"""Bad command-line input: an error naming the bad value and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cobali.config import flags as options
from cobali.faces import cli


@pytest.mark.parametrize(("argv", "fragment"), [
    (["run", "--prompts", "x.txt", "--max-slots", "0"], "--max-slots: expected a positive integer, got 0"),
    (["run", "--prompts", "x.txt", "--mode", "fast"], "invalid choice: 'fast'"),
    (["run", "--prompts", "x.txt", "--itl-target-ms", "nan"], "expected a number >= 0, got nan"),
    (["run", "--prompts", "/nonexistent/p.txt"], "prompts file not found: /nonexistent/p.txt"),
    (["run", "--prompts", "x.csv"], "prompts file not found: x.csv"),
    (["calibrate", "--repeats", "0"], "--repeats: expected a positive integer, got 0"),
    (["calibrate", "--text-sample", "no_such_scenario"], "--text-sample 'no_such_scenario': no such file"),
    (["simulate", "--prompts", "short_burst", "--chars-per-token", "0"], "--chars-per-token: expected a number > 0"),
    (["simulate", "--prompts", "short_burst", "--async-scheduling"], "--async-scheduling: the simulator's virtual"),
    (["simulate", "--prompts", "short_burst", "--num-speculative-tokens", "2"], "--num-speculative-tokens 2: the "),
    (["synth-lora", "--out", "/tmp/x.gguf", "--model", "/nonexistent.gguf"], "--model /nonexistent.gguf: no such file"),
    (["synth-lora", "--out", "/tmp/x.gguf", "--targets", "nope"], "has no weights named like nope"),
    (["synth-lora", "--out", "/tmp/x.gguf", "--rank", "0"], "--rank: expected a positive integer, got 0"),
    (["bench", "--configs", "seq,warp", "--prompts", "short_burst"], "unknown config 'warp'"),
    (["bench", "fidelity", "--prompts", "short_burst", "--epsilon", "0"], "--epsilon: expected a number > 0, got 0"),
    (["bench", "fidelity", "--prompts", "no_such_scenario"], "--prompts 'no_such_scenario': no such file"),
    (["bench", "fidelity", "--prompts", "short_burst", "--system-prompt-file", "/nonexistent/s.txt"],
     "--system-prompt-file '/nonexistent/s.txt': No such file or directory"),
    (["bench", "fidelity", "--prompts", "short_burst", "--mode", "fast"], "invalid choice: 'fast'"),
    (["serve", "--stream-interval", "0"], "--stream-interval: expected a positive integer, got 0"),
    (["serve", "--host-cache-mib", "-1"], "--host-cache-mib: expected an integer >= 0, got -1"),
    (["serve", "--host-cache-mib", "1.5"], "--host-cache-mib: expected an integer >= 0, got '1.5'"),
])
def test_bad_flags_name_the_value(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_missing_profile_for_an_itl_target_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", "--prompts", str(prompts), "--itl-target-ms", "100", "--profile", "no-such-profile"])
    assert exit_info.value.code == 2
    assert "--profile 'no-such-profile'" in capsys.readouterr().err


def test_a_bad_chat_template_file_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for %}")
    for path, fragment in [(tmp_path / "missing.jinja", "cannot read the chat template"),
                           (broken, "the chat template does not compile")]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--chat-template", str(path), "--port", "0"])
        assert exit_info.value.code == 2
        assert fragment in capsys.readouterr().err


def test_the_host_cache_defaults_to_8_gib_and_at_most_a_quarter_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(options.os, "sysconf", lambda name: pages.get(name, 4 * 2**30 // 4096))
    assert options.default_host_cache_mib() == 1024, "4 GiB of memory"
    pages["SC_PHYS_PAGES"] = 64 * 2**30 // 4096
    assert options.default_host_cache_mib() == 8192, "64 GiB"


def test_help_never_asks_the_os_for_its_memory(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Windows has no os.sysconf: building the parser must not call it, and the default must not need it."""
    monkeypatch.delattr(options.os, "sysconf", raising=False)
    for argv in (["--help"], ["serve", "--help"], ["bench", "--help"], ["run", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0, argv
    assert "--host-cache-mib" in capsys.readouterr().out
    assert options.default_host_cache_mib() == 8192, "llama-server's default where the memory is unknown"


def test_the_help_runs_without_what_windows_lacks() -> None:
    """No `resource` module and no os.sysconf, as on Windows: importing cobali and printing the help still work."""
    script = ("import os, sys; sys.modules['resource'] = None; del os.sysconf\n"
              "from cobali.faces import cli\n"
              "for argv in (['--help'], ['serve', '--help'], ['bench', '--help']):\n"
              "    try:\n"
              "        cli.main(argv)\n"
              "    except SystemExit as done:\n"
              "        assert done.code == 0, argv\n"
              "print(cli.__name__, 'ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("cobali.faces.cli ok\n"), done.stderr[-3000:]


def test_the_host_cache_default_is_resolved_when_the_engine_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "default_host_cache_mib", lambda: 1234)
    parser = cli.build_parser()
    assert options.engine_config(parser.parse_args(["run", "--prompts", "x.txt"])).host_cache_mib == 1234
    given = parser.parse_args(["run", "--prompts", "x.txt", "--host-cache-mib", "0"])
    assert options.engine_config(given).host_cache_mib == 0
