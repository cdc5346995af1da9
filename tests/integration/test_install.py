"""The slim install: `pip install .` (no extras) into a fresh venv, as a user who only serves would run it.

llama-cpp-python comes from the wheel `make install` caches (scripts/install.sh: ~/.cache/cobali/wheels/<key>);
everything else from the package index. Without that wheel the test skips (building it here would take minutes),
except under CI, where `make test` has just built it and a skip would prove nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.unit.http.test_reliability import soak_module

REPO = Path(__file__).resolve().parents[2]
# Distributions (by name prefix) a server must not need: the dev, ray and plot extras.
FORBIDDEN = ("pytest", "ray", "langchain", "matplotlib", "schemathesis", "hypothesis")
MODULES = ("pytest", "ray", "langchain", "langchain_openai", "matplotlib", "schemathesis", "hypothesis")
PLOT_HINT = "pip install 'cobali[plot]'"
# The checkout as `pip install .` sees it, less what is built or cached in it.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "results", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", "gpu_bundle", ".whl", ".gl")

pytestmark = pytest.mark.slow


def wheel_dir() -> Path:
    """Where scripts/install.sh caches llama-cpp-python's wheel for this CMAKE_ARGS (the same key)."""
    key = hashlib.sha1((os.environ.get("CMAKE_ARGS") or "cpu").encode()).hexdigest()[:10]
    root = Path(os.environ.get("COBALI_WHEEL_CACHE") or Path.home() / ".cache" / "cobali" / "wheels")
    wheels = root / key
    if not any(wheels.glob("llama_cpp_python-*.whl")):
        message = f"no cached llama-cpp-python wheel in {wheels}: `make install` builds it (a few minutes)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return wheels


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    # No PYTHONPATH: the fresh venv must see nothing of this one.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slim_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = wheel_dir()
    root = tmp_path_factory.mktemp("slim")
    source = root / "cobali"
    shutil.copytree(REPO, source, ignore=NOT_SOURCE)  # setuptools builds in the tree: not in this checkout
    venv = root / "venv"
    done = run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    assert done.returncode == 0, done.stderr
    done = run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--find-links", str(wheels), "."],
               cwd=source, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv


def test_a_plain_install_brings_no_extra(slim_venv: Path, tmp_path: Path) -> None:
    probe = ("import importlib.metadata as m, importlib.util as u, json; print(json.dumps({"
             "'dists': sorted(d.metadata['Name'].lower() for d in m.distributions()), "
             f"'modules': [n for n in {MODULES!r} if u.find_spec(n) is not None]}}))")
    done = run([str(slim_venv / "bin" / "python"), "-c", probe], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert "cobali" in found["dists"] and "llama_cpp_python" in [d.replace("-", "_") for d in found["dists"]]
    assert [d for d in found["dists"] if d.startswith(FORBIDDEN)] == []
    assert found["modules"] == []


def test_the_help_runs_without_the_extras_or_the_embedded_model(slim_venv: Path, tmp_path: Path) -> None:
    for argv in (["--help"], ["serve", "--help"], ["bench", "--help"]):
        done = run([str(slim_venv / "bin" / "cobali"), *argv], cwd=tmp_path)
        assert done.returncode == 0, (argv, done.stderr)
    assert "--model" in done.stdout


def test_bench_names_the_extra_that_draws_its_plots(slim_venv: Path, tmp_path: Path, model_path: str) -> None:
    out = tmp_path / "out"
    done = run([str(slim_venv / "bin" / "cobali"), "bench", "--model", model_path, "--threads", "1",
                "--prompts", str(REPO / "workloads" / "prompts_16.txt"), "--num-prompts", "2", "--max-new", "4",
                "--max-slots", "2", "--configs", "cont", "--out", str(out)], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert PLOT_HINT in done.stderr
    assert (out / "summary.json").exists(), "the data is written without the plots"
    assert list(out.glob("*.png")) == []


def test_the_slim_install_serves_a_chat_completion(slim_venv: Path, model_path: str) -> None:
    cobali = str(slim_venv / "bin" / "cobali")
    command = [cobali, "serve", "--model", model_path, "--threads", "1", "--max-slots", "2", "--host", "127.0.0.1"]
    with soak_module().started_process(lambda port: [*command, "--port", str(port)]) as (url, _proc):
        reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]
