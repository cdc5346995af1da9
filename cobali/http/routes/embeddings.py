"""POST /v1/embeddings: pooled embeddings from the model, through a llama.cpp embeddings context of its own.

Vectors are L2-normalized, as OpenAI's are (so a dot product is the cosine). Several inputs share one
decode. The work runs on a worker thread, one request at a time, beside the engine's generation.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, model_validator

from cobali.frontend.errors import bad_request
from cobali.frontend.inputs import InputProcessor
from cobali.frontend.work_pool import client_of
from cobali.http.generation import inputs_for
from cobali.http.parse import json_body, parse_body
from cobali.http.protocol.bodies import RequestBody, one_of, text_batch
from cobali.http.protocol.unknown_fields import ignored_fields_headers
from cobali.http.state import ServerContext

MAX_INPUTS = 2048  # OpenAI's limit per request

router = APIRouter()


class EmbeddingRequest(RequestBody):
    input: Annotated[str | list[str] | list[int] | list[list[int]],
                     one_of("a string, a list of strings, token ids, or a list of token id lists")]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EmbeddingRequest:
        inputs = self.inputs()
        if not inputs or len(inputs) > MAX_INPUTS:
            raise ValueError(f"input must hold 1 to {MAX_INPUTS} items, got {len(inputs)}")
        if not all(inputs):
            raise ValueError("input must not contain empty strings or empty token lists")
        return self

    def inputs(self) -> list[str | list[int]]:
        return text_batch(self.input)


def _tokens(inputs: InputProcessor, item: str | list[int], max_tokens: int) -> list[int]:
    tokens = inputs.tokenizer.encode(item) if isinstance(item, str) else item
    inputs.check_token_ids(tokens, "input token ids", "input")
    if len(tokens) > max_tokens:
        raise bad_request(f"an input has {len(tokens)} tokens; embeddings take at most {max_tokens}", "input")
    return tokens


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, what the openai SDK decodes
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings", openapi_extra=json_body(EmbeddingRequest))
async def embeddings(http: Request) -> JSONResponse:
    body = await parse_body(http, EmbeddingRequest)
    server: ServerContext = http.app.state.server
    inputs = inputs_for(http, body.model)
    limits = inputs.model.embeddings
    if body.dimensions is not None and body.dimensions != limits.n_embd:
        raise bad_request(f"dimensions: this model's embeddings have {limits.n_embd} dimensions and cannot be "
                          "shortened", "dimensions")
    tokens = await server.pool.run(client_of(http), lambda: [_tokens(inputs, item, limits.max_tokens)
                                                             for item in body.inputs()])
    vectors = await server.client.embed(tokens)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = vectors / np.where(norms > 0, norms, 1.0)
    n_tokens = sum(map(len, tokens))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": server.model_name,
                         "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}},
                        headers=ignored_fields_headers(body))
