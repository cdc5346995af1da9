"""Issue 38: the routes reach the model only through the frontend (ModelInfo, the Tokenizer, the engine client),
and never call the backend on the event loop: tokenizing, templates and embeddings run on worker threads, and
/slots is a snapshot the engine thread takes. Checked by where each backend call runs, for every route."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cobali.backends.base import EmbeddingLimits, TemplateSource
from cobali.backends.fake import FakeBackend
from cobali.frontend.client import EngineClient
from cobali.http import parse
from tests.unit.http.test_parse_off_loop import BODIES, on_loop
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy

GETS = ("/health", "/v1/models", "/v1/models/fake-model", "/slots", "/metrics")
# Beyond each route's body: the fake's template refuses tools, so a prompt reaches the tokenizer here.
MORE_POSTS = [("/tokenize", {"prompt": "hi", "return_token_strs": True}),
              ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "echo": True})]


class WatchedBackend(FakeBackend):
    """Records every call of the frontend's side of the backend made on an event loop's thread."""

    def __init__(self) -> None:
        super().__init__(n_seq_max=4, n_ctx_seq=N_CTX_SEQ, n_batch=64)
        self.on_loop: list[str] = []

    def _seen(self, name: str) -> None:
        if on_loop():
            self.on_loop.append(name)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self._seen("tokenize")
        return super().tokenize(text, add_special)

    def token_bytes(self, token: int) -> bytes:
        self._seen("token_bytes")
        return super().token_bytes(token)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        self._seen("apply_chat_template")
        return super().apply_chat_template(messages)

    def chat_template_source(self) -> TemplateSource:
        self._seen("chat_template_source")
        return super().chat_template_source()

    @property
    def embedding_limits(self) -> EmbeddingLimits:
        self._seen("embedding_limits")
        return super().embedding_limits

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        self._seen("embed")
        return super().embed(inputs)


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, WatchedBackend]]:
    # Every body as one over the bound: a short light one is tokenized on the loop (test_inline_prepare.py)
    monkeypatch.setattr(parse, "INLINE_BODY_BYTES", -1)
    backend = WatchedBackend()
    with TestClient(fake_app(fake_engine(backend), "fake-model", runtime_lora=True)) as client:
        wait_healthy(client)
        yield client, backend


def _every_route(client: TestClient) -> None:
    for path, body in [*BODIES.items(), *MORE_POSTS]:
        assert client.post(path, json=body).status_code < 500, path
    for path in GETS:
        assert client.get(path).status_code == 200, path


def test_no_route_calls_the_backend_on_the_event_loop(watched: tuple[TestClient, WatchedBackend]) -> None:
    client, backend = watched
    _every_route(client)
    assert backend.on_loop == []


def test_an_embedding_run_on_the_event_loop_is_caught(watched: tuple[TestClient, WatchedBackend],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: the client embeds inline, as the route once did before the thread hop."""
    client, backend = watched

    async def inline(self: EngineClient, inputs: list[list[int]]) -> np.ndarray:
        return self.transport.engine.embed(inputs)

    monkeypatch.setattr(EngineClient, "embed", inline)
    assert client.post("/v1/embeddings", json=BODIES["/v1/embeddings"]).status_code == 200
    assert backend.on_loop == ["embed"]
