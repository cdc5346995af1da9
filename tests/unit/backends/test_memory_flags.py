"""The memory flags reach LlamaCppConfig, bad combinations fail before the model loads, --fit's arithmetic, and a
request too long for its context names the flags that give it more."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.memory import FIT_MARGIN_BYTES, fit_cells
from cobali.config.flags import add_engine_args, backend_config
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from tests.unit.http.test_server_api import fake_app, wait_healthy


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def test_the_memory_flags_reach_the_backend_config() -> None:
    config = backend_config(parsed("--cache-type-k", "q8_0", "--cache-type-v", "q4_0", "--flash-attn", "on",
                                   "--fit", "--verbose"))
    assert (config.cache_type_k, config.cache_type_v, config.flash_attn, config.fit, config.verbose) == (
        "q8_0", "q4_0", "on", True, True)
    default = backend_config(parsed())
    assert (default.cache_type_k, default.cache_type_v, default.flash_attn, default.fit, default.verbose) == (
        "f16", "f16", "auto", False, False)


def test_a_quantized_v_cache_without_flash_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="--cache-type-v q8_0 needs flash attention: use --flash-attn on or auto"):
        backend_config(parsed("--cache-type-v", "q8_0", "--flash-attn", "off"))
    assert backend_config(parsed("--cache-type-k", "q8_0", "--flash-attn", "off")).cache_type_k == "q8_0"
    with pytest.raises(ValueError, match="--cache-type-k: unknown cache type 'q3_k'"):
        LlamaCppConfig(cache_type_k="q3_k")


@pytest.mark.parametrize(("argv", "message"), [
    (("--hf-file", "a.gguf"), "--hf-file needs --hf-repo"),
    (("--model", "a.gguf", "--hf-repo", "o/n"), "--model and --hf-repo are exclusive"),
])
def test_model_flags_that_cannot_go_together(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        backend_config(parsed(*argv))


def test_a_unified_kv_gets_as_many_cells_as_the_streams_would() -> None:
    assert LlamaCppConfig(n_seq_max=16, kv_unified=True).total_cells(8192) == 16 * 2048
    assert LlamaCppConfig(n_seq_max=16).total_cells(1024) == 16 * 1024


def test_fit_keeps_a_margin_rounds_per_stream_and_never_grows_past_what_was_asked() -> None:
    gib = 2**30
    cell = 1000
    budget = 4 * gib - gib - max(FIT_MARGIN_BYTES, 4 * gib // 10)
    per_stream = budget // cell // 4 // 256 * 256
    assert fit_cells(4 * gib, gib, cell, 10**9, 4) == per_stream * 4
    assert fit_cells(4 * gib, gib, cell, 5000, 4) == 5000  # fits whole: left as asked
    assert fit_cells(gib, gib, cell, 5000, 4) == 0


@pytest.mark.parametrize(("unified", "hint"), [
    (False, "the 1024 KV cells are split over 4 slots: start with a larger --ctx, fewer --max-slots, --kv-unified"),
    (True, "the KV pool has 256 cells: start with a larger --ctx (or --fit)"),
])
def test_a_prompt_past_the_context_names_the_flags_that_give_it_more(unified: bool, hint: str) -> None:
    backend = FakeBackend(n_seq_max=4, n_ctx_seq=256, n_batch=64, kv_unified=unified)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=64))
    with pytest.raises(ValueError, match="context holds") as refused:
        engine.add_request(list(range(1, 300)))
    assert hint in str(refused.value)
    with TestClient(fake_app(lambda: engine, "fake-model")) as api:
        wait_healthy(api)
        reply = api.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 400})
        assert reply.status_code == 400 and hint in reply.json()["error"]["message"], reply.text
