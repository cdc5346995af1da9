"""/v1/embeddings through the official `openai` SDK over the fake backend (whose embedding counts tokens)."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from cobali.backends.fake import FakeBackend
from tests.unit.http.test_server_api import N_CTX_SEQ, fake_app, fake_engine, wait_healthy


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    with TestClient(fake_app(fake_engine(), "fake-model")) as http:
        wait_healthy(http)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def counts(text: str) -> np.ndarray:
    vector = FakeBackend().embed([FakeBackend().tokenize(text)])[0]
    return vector / np.linalg.norm(vector)


def test_string_list_and_token_inputs_give_unit_vectors_in_order(client: OpenAI) -> None:
    texts = ["abc", "hello there", "zzz"]
    response = client.embeddings.create(model="fake-model", input=texts, encoding_format="float")
    assert [d.index for d in response.data] == [0, 1, 2]
    for datum, text in zip(response.data, texts, strict=True):
        assert datum.embedding == pytest.approx(counts(text).tolist(), abs=1e-6)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, texts))
    tokens = FakeBackend().tokenize("abc")
    by_ids = client.embeddings.create(model="fake-model", input=[tokens, tokens], encoding_format="float")
    assert by_ids.data[1].embedding == pytest.approx(response.data[0].embedding)
    single = client.embeddings.create(model="fake-model", input="abc", encoding_format="float")
    assert single.data[0].embedding == pytest.approx(response.data[0].embedding)


def test_base64_is_little_endian_float32(client: OpenAI) -> None:
    raw = client.embeddings.with_raw_response.create(model="fake-model", input="abc", encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), dtype="<f4") == pytest.approx(counts("abc"), abs=1e-6)
    # The SDK asks for base64 by default and decodes it itself.
    assert client.embeddings.create(model="fake-model", input="abc").data[0].embedding == pytest.approx(
        counts("abc").tolist(), abs=1e-6)


@pytest.mark.parametrize(("kwargs", "fragment"), [
    ({"input": ""}, "empty"),
    ({"input": []}, "1 to 2048"),
    ({"input": ["a"] * 2049}, "1 to 2048"),
    ({"input": "a" * (N_CTX_SEQ + 1)}, f"at most {N_CTX_SEQ}"),
    ({"input": [10**9]}, "token ids"),
    ({"input": "a", "dimensions": 8}, "cannot be shortened"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400(client: OpenAI, kwargs: dict, fragment: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="fake-model", **kwargs)
    assert fragment in caught.value.message


def test_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
