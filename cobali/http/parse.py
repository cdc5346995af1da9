"""Request bodies read, JSON-parsed and validated on the worker pool (work_pool.py), not on the event loop.

A body may be megabytes of JSON (up to --max-body-bytes): parsing and validating it, on the loop as FastAPI does
for a `body: Model` parameter, would stall every stream the server is sending. So a route takes only the Request
and awaits parse_body, which does what FastAPI would do, answer for answer, on a worker: the same content-type
rule, the same `json.loads`, the same validation (Python mode, as FastAPI's), the same 400s. Its body still
appears in /openapi.json: the route's openapi_extra is json_body(Model), and document_bodies adds the schemas.

A body of at most INLINE_BODY_BYTES whose route says its work is light (parse_then's `inline`) is parsed and
prepared on the loop instead: the hop to a worker and back (a queue put that wakes a thread, a thread-safe callback
that wakes the loop, and the two threads trading the GIL) cost the loop more than such a body's work, and at
hundreds of short requests a second it was a third of the server's CPU (docs/results.md, issue 46).
"""

from __future__ import annotations

import email.message
import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.models import OpenAPI
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from cobali.frontend.errors import bad_request, validation_error
from cobali.frontend.work_pool import client_of

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# The most a body handled on the event loop may weigh: its JSON parse, validation, tokenizing and limit checks are
# linear in it, tens of microseconds at this size, so the loop's worst case for one such request stays bounded.
INLINE_BODY_BYTES = 2048
REF_PREFIX = "#/components/schemas/"
_MODELS: dict[str, type[BaseModel]] = {}  # every model a route's json_body names, by its schema's name


async def parse_body(http: Request, model: type[M]) -> M:
    """The request's body as `model`, parsed and validated on the worker pool; a 400 as FastAPI's otherwise."""
    return await parse_then(http, model, _itself)


async def parse_then(http: Request, model: type[M], then: Callable[[M], T],
                     inline: Callable[[M], bool] | None = None) -> T:
    """then(body) on the worker that parsed it: more of the route's O(body) work kept off the loop. A body of at
    most INLINE_BODY_BYTES is parsed here when the route gives `inline`, and then(body) runs here too when
    inline(body) says it is light (its cost bounded by the body's size); else on a worker."""
    raw = await http.body()  # read whole already: BodyLimit bounded and buffered it
    content_type = http.headers.get("content-type")
    if inline is not None and len(raw) <= INLINE_BODY_BYTES:
        body = validated(model, raw, content_type)
        if inline(body):
            return then(body)
        work = functools.partial(then, body)
    else:
        work = functools.partial(_parsed, model, raw, content_type, then)
    return await http.app.state.server.pool.run(client_of(http), work)


def _itself(body: M) -> M:
    return body


def _parsed(model: type[M], raw: bytes, content_type: str | None, then: Callable[[M], T]) -> T:
    return then(validated(model, raw, content_type))


def validated(model: type[M], raw: bytes, content_type: str | None) -> M:
    """FastAPI's reading of a JSON body, step for step (fastapi.routing, strict content type): an empty body is
    a missing one; only a JSON content type is parsed, any other body is validated as the bytes it is."""
    if not raw:
        raise validation_error(RequestValidationError([{"type": "missing", "loc": ("body",),
                                                        "msg": "Field required", "input": None}]))
    data: Any = raw
    if content_type and _is_json(content_type):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise validation_error(RequestValidationError([{"type": "json_invalid", "loc": ("body", err.pos),
                                                            "msg": "JSON decode error", "input": {},
                                                            "ctx": {"error": err.msg}}])) from None
        except Exception:  # not UTF-8, nested past the recursion limit: FastAPI's words for it
            raise bad_request("There was an error parsing the body") from None
    try:
        return model.model_validate(data, from_attributes=True)  # FastAPI validates a body with from_attributes
    except ValidationError as err:
        raise validation_error(err) from None


@functools.lru_cache(maxsize=64)  # a client sends one content type again and again; parsing it was ~3 % of the loop
def _is_json(content_type: str) -> bool:
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's openapi_extra: its request body, as FastAPI documents a `body: model` parameter."""
    if _MODELS.setdefault(model.__name__, model) is not model:  # FastAPI would qualify both names; this cannot
        raise ValueError(f"two request bodies named {model.__name__}")
    return {"requestBody": {"content": {"application/json": {"schema": {"$ref": REF_PREFIX + model.__name__}}},
                            "required": True}}


def document_bodies(app: FastAPI) -> None:
    """app.openapi() with the schemas of the bodies its operations name (json_body), under components/schemas."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        spec = generate()  # FastAPI's, kept as app.openapi_schema until its routes change
        names = _body_refs(spec)
        if any(name not in spec.get("components", {}).get("schemas", {}) for name in names):
            _, defs = models_json_schema([(_MODELS[name], "validation") for name in names],
                                         ref_template=REF_PREFIX + "{model}")
            schemas = {**spec.get("components", {}).get("schemas", {}), **defs.get("$defs", {})}
            spec.setdefault("components", {})["schemas"] = dict(sorted(schemas.items()))
            # Written out as FastAPI writes its own (no null defaults, numbers as its OpenAPI model types them).
            app.openapi_schema = spec = jsonable_encoder(OpenAPI(**spec), by_alias=True, exclude_none=True)
        return spec

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its spec


def _body_refs(spec: dict[str, Any]) -> list[str]:
    """The json_body models the spec's operations name."""
    refs = set()
    for operation in (op for path in spec.get("paths", {}).values() for op in path.values()):
        content = operation.get("requestBody", {}).get("content", {}) if isinstance(operation, dict) else {}
        ref = content.get("application/json", {}).get("schema", {}).get("$ref", "").removeprefix(REF_PREFIX)
        if ref in _MODELS:
            refs.add(ref)
    return sorted(refs)
