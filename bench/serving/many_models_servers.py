"""The servers bench/serving/many_models.py starts itself: the model files (the embedded model and `cobali
synth-model` shapes, cached), the memory budget that fits two of three, and `cobali serve --models` and
llama-server's router mode on the same files, slots, context and threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp.loading import repack_flag
from cobali.faces.synth_model import SHAPES, ModelShape, synth_model

LLAMA_SERVER = Path.home() / ".cache" / "cobali" / "llama.cpp" / "build" / "bin" / "llama-server"
MIB = 2**20
# Two synth shapes beside the embedded SmolLM2-135M (94 MiB): ~240 and ~335 MiB on disk, each loading in
# about a second on 2 cores, so that a cold start stands out from a warm one.
SYNTH: dict[str, tuple[ModelShape, str]] = {
    "qwen-12l": (replace(SHAPES["qwen2.5-0.5b"], n_layer=12), "Q4_0"),
    "qwen-24l": (SHAPES["qwen2.5-0.5b"], "Q4_0"),
}


def synth_cache() -> Path:
    return Path(os.environ.get("COBALI_CACHE") or Path.home() / ".cache" / "cobali") / "synth"


def synth_file(name: str) -> str:
    """The shape's GGUF, written once into the cache (a few seconds) and reused after."""
    shape, quant = SYNTH[name]
    path = synth_cache() / f"{name}-{quant}.gguf"
    if not path.exists():
        staging = path.with_name(path.name + ".part")  # a run cut short leaves no half-written model
        synth_model(shape, quant, str(staging), embedded_model_path())
        os.replace(staging, path)
    return str(path)


def default_files() -> dict[str, str]:
    return {"smollm2-135m": embedded_model_path(), **{name: synth_file(name) for name in SYNTH}}


def parse_files(specs: Sequence[str]) -> dict[str, str]:
    files = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not os.path.isfile(path):
            raise ValueError(f"--files {spec!r}: expected NAME=PATH of a GGUF file")
        if name in files:
            raise ValueError(f"--files: {name!r} named twice")
        files[name] = path
    return files


def footprints(files: dict[str, str], overhead_bytes: int) -> list[int]:
    """What each model's process holds, guessed: its file (mapped, all read) and a fixed overhead for its KV,
    compute buffers and runtime (measured on 2 cores: ~65-80 MiB for a llama-server child, ~120 MiB for a cobali
    engine process)."""
    return [os.path.getsize(path) + overhead_bytes for path in files.values()]


def default_budget(footprint: Sequence[int]) -> int:
    """Room for the two largest models and half the smallest: any two fit, all three don't."""
    assert len(footprint) >= 3, footprint
    ordered = sorted(footprint)
    return sum(ordered[-2:]) + ordered[0] // 2


def fit_count(footprint: Sequence[int], budget: int) -> int:
    """How many models the budget holds, the largest first: llama-server's --models-max for the same budget."""
    ordered, count = sorted(footprint, reverse=True), 0
    while count < len(ordered) and sum(ordered[:count + 1]) <= budget:
        count += 1
    return max(count, 1)


@dataclass(frozen=True)
class Setup:
    files: dict[str, str]  # name -> GGUF path, the first three in the order of the phases' A, B, C
    budget_bytes: int
    overhead_bytes: int  # of a model's process, besides its file: in llama-server's --models-max
    slots: int
    ctx: int
    threads: int
    min_resident: str  # cobali's --models-min-resident
    llama_server: str


def cobali_command(setup: Setup, port: int) -> list[str]:
    models = [f"{name}={path}" for name, path in setup.files.items()]
    # --models-max is the model count: the memory budget alone decides evictions. The load cap per client is
    # lifted: this one client forces loads on purpose (llama-server caps none).
    return [sys.executable, "-m", "cobali.faces.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--models", *models, "--models-memory", f"{setup.budget_bytes // MIB}MiB",
            "--models-max", str(len(setup.files)), "--models-loads-per-client", "1000000",
            "--models-min-resident", setup.min_resident,
            "--models-keep-alive", "5m", "--max-slots", str(setup.slots), "--ctx", str(setup.ctx),
            "--threads", str(setup.threads)]


def llama_server_command(setup: Setup, models_dir: Path, port: int) -> list[str]:
    """llama-server evicts by count: --models-max is the count the budget fits. --repack or --no-repack as cobali
    loads the models (one flag for all of them in router mode); --no-kv-unified: one KV stream per slot, as
    cobali's default layout (the flags of bench/serving/vs_llama_server.sh)."""
    fits = fit_count(footprints(setup.files, setup.overhead_bytes), setup.budget_bytes)
    repack = {name: repack_flag(path) for name, path in setup.files.items()}
    if len(set(repack.values())) > 1:
        raise ValueError(f"cobali repacks some of these models and not others ({repack}): llama-server's router "
                         "takes one --repack for all of them")
    return [setup.llama_server, "--models-dir", str(models_dir), "--models-max", str(fits),
            "-np", str(setup.slots), "-c", str(setup.ctx), "--no-kv-unified", "-t", str(setup.threads),
            "-tb", str(setup.threads), "-b", "512", "-ub", "512", *set(repack.values()), "--host", "127.0.0.1",
            "--port", str(port)]


def link_models(files: dict[str, str], folder: Path) -> Path:
    """llama-server's --models-dir: one symlink per model, its stem the model's name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        (folder / f"{name}.gguf").symlink_to(os.path.abspath(path))
    return folder


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _log_tail(path: Path, lines: int = 8) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def serving(name: str, command: list[str], port: int, log: Path,
            startup_s: float = 180) -> Iterator[tuple[str, int]]:
    """(URL, pid) of the server `name` that `command` starts on 127.0.0.1:port, once its /health answers 200. It
    runs in a session of its own, so that the model processes it started go with it: SIGTERM, then SIGKILL to the
    group."""
    url = f"http://127.0.0.1:{port}"
    if _healthy(url):
        raise RuntimeError(f"port {port} already serves something: pick another --port")
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not become healthy (exit status {proc.poll()}); "
                                   f"the end of {log}:\n{_log_tail(log)}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                print(f"  {name} did not exit 60 s after SIGTERM: SIGKILL", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
        _end_group(proc.pid)


def _end_group(pgid: int, grace_s: float = 10) -> None:
    """Model processes that outlive their server get grace_s to exit, then SIGKILL."""
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is empty
