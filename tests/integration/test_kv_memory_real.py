"""KV cache types and flash attention reach llama.cpp; the load line says what the model takes; --fit sizes the
context to memory; a model or context that fails says why. Read back from llama.cpp itself: the lines it logs
while it makes the context (its KV buffer's types, its resolved flash attention) and the bytes a saved sequence
takes."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cobali.backends.llama_cpp import LlamaCppBackend, loading
from cobali.backends.llama_cpp import backend as backend_module
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.tools import llama_logs
from cobali.backends.memory import fit_cells

COBALI = str(Path(sys.executable).with_name("cobali"))
SMALL = {"n_ctx": 512, "n_seq_max": 2, "n_batch": 64}


def made(**settings) -> tuple[LlamaCppBackend, str]:
    """A backend, and the text llama.cpp logged while it was made."""
    logs = llama_logs()
    mark = logs.count
    backend = LlamaCppBackend(LlamaCppConfig(**{**SMALL, **settings}))
    return backend, "\n".join(text for _, text in logs.since(mark))


def saved_bytes(backend: LlamaCppBackend, n: int = 40) -> int:
    tokens = np.arange(200, 200 + n, dtype=np.int32)
    backend.decode(tokens, np.arange(n, dtype=np.int32), np.ones(n, dtype=np.int32), np.zeros(n, dtype=np.int8))
    return backend.save_seq(1).nbytes


@pytest.mark.parametrize(("k", "v", "flash", "resolved"), [
    ("q8_0", "q4_0", "on", "flash_attn            = enabled"),
    ("q4_0", "f16", "off", "flash_attn            = disabled"),
    ("f16", "q8_0", "auto", "enabling flash_attn since it is required for quantized V cache"),
])
def test_cache_types_and_flash_attention_reach_llama_cpp(k: str, v: str, flash: str, resolved: str) -> None:
    backend, said = made(cache_type_k=k, cache_type_v=v, flash_attn=flash)
    try:
        assert f"K ({k})" in said and f"V ({v})" in said, said[-2000:]
        assert resolved in said
        # A sequence saves its cells in the cache's types: what the host KV tier sizes itself by.
        n, per_token = 40, backend.info.kv_bytes_per_token
        assert abs(saved_bytes(backend, n) - n * per_token) < 1024
        assert per_token < 23052  # SmolLM2's f16 token
    finally:
        backend.close()


def test_the_load_line_says_backend_layers_weights_kv_and_context(caplog: pytest.LogCaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "gpu_present", lambda: "/dev/nvidia0")
    with caplog.at_level(logging.INFO, logger="cobali"):
        backend, _ = made(cache_type_k="q8_0", cache_type_v="q8_0")
        backend.close()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    for part in ("(CPU-only build)", "0/31 layers offloaded", "weights 92.1 MiB",
                 "KV 6.0 MiB (512 cells x 12240 B, K q8_0 / V q8_0, a stream per slot)",
                 "256 tokens of context per slot x 2 slots", "flash attention enabled", "free in host memory"):
        assert part in line, line
    warning = next(r for r in caplog.records if r.levelno == logging.WARNING).getMessage()
    assert "GPU (/dev/nvidia0) but this llama.cpp build is CPU-only" in warning


@pytest.mark.parametrize("verbose", [False, True])
def test_every_face_logs_the_load_line_and_verbose_lets_llama_cpp_through(tmp_path: Path, verbose: bool) -> None:
    (prompts := tmp_path / "prompts.txt").write_text("Hello\n")
    done = subprocess.run([COBALI, "run", "--prompts", str(prompts), "--max-new", "1", "--threads", "1",
                           *(["--verbose"] if verbose else [])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "INFO cobali.backend: loaded llama 256M Q4_1 (CPU-only build)" in done.stderr, done.stderr[-2000:]
    assert ("llama_kv_cache: size =" in done.stderr) is verbose


def test_fit_sizes_the_context_to_the_memory_there_is(monkeypatch: pytest.MonkeyPatch) -> None:
    free = 2 * 2**30
    monkeypatch.setattr(loading, "host_available", lambda: free)
    backend, _ = made(n_ctx=0, n_seq_max=16, n_batch=512, fit=True)
    try:
        weights_and_logits = 96576768 + 2 * 512 * 49152 * 4
        expected = fit_cells(free, weights_and_logits, 23040, 16 * 8192, 16)
        assert backend.info.n_ctx == expected and 2048 < backend.info.n_ctx_seq < 8192
    finally:
        backend.close()
    monkeypatch.setattr(loading, "host_available", lambda: 600 * 2**20)
    with pytest.raises(ValueError, match=r"--fit: no context fits: 600.0 MiB free in host memory"):
        made(fit=True)


def test_a_kv_cache_past_the_memory_is_refused_before_llama_cpp_touches_it() -> None:
    with pytest.raises(ValueError, match=r"the KV cache does not fit: n_ctx=1073741824 cells for 2 slots, K cache "
                                         r"f16, V cache f16, flash attention auto: KV ~22.5 TiB, .* free in host "
                                         r"memory; lower --ctx or --max-slots, quantize the cache"):
        made(n_ctx=2**30)


def test_a_context_llama_cpp_refuses_says_what_was_asked_and_why() -> None:
    with pytest.raises(ValueError, match=r"could not create a llama.cpp context \(n_ctx=300 cells for 300 slots, K "
                                         r"cache f16, V cache f16, flash attention auto: KV ~6.6 MiB.*\): llama.cpp: "
                                         r".*n_seq_max must be <= 256"):
        made(n_ctx=300, n_seq_max=300, n_batch=512)


def write_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("content", "message"), [
    (None, "model file not found"),
    (b"<html>not a model</html>", r"is not a GGUF file \(it starts with b'<htm', not b'GGUF'\)"),
    (b"GGUF\x03\x00\x00\x00garbage", r"could not load a GGUF model from .*: its GGUF header cannot be read: the file "
                                      r"is damaged or cut short"),
    ("nosucharch", r"its architecture 'nosucharch' is unknown to llama.cpp .* \(llama-cpp-python 0.3.36\): a newer "
                   r"llama-cpp-python may know it \(llama.cpp: .*unknown model architecture: 'nosucharch'"),
])
def test_a_model_that_fails_to_load_says_why(tmp_path: Path, content: bytes | str | None, message: str) -> None:
    path = tmp_path / "model.gguf"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        write_gguf(path, content)
    with pytest.raises(ValueError, match=message):
        LlamaCppBackend(LlamaCppConfig(str(path), **SMALL))


def test_a_model_larger_than_the_memory_says_so(model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading, "host_available", lambda: 2**20)
    said = [(4, "llama_model_load: error loading model: failed to allocate CPU buffer")]
    assert loading.load_failure(model_path, said) == (
        f"could not load a GGUF model from {model_path}: its weights take 93.8 MiB and 1.0 MiB of memory is "
        "available (llama.cpp: llama_model_load: error loading model: failed to allocate CPU buffer)")
