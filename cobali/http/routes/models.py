"""The routes of a server of many models that no one model serves: health, metrics, the model list (OpenAI's
/v1/models, and llama-server's router endpoints GET /models, POST /models/load and /models/unload), and every
loaded model's slots. Behind the key, but for /health and /metrics (cobali.http.auth)."""

from __future__ import annotations

import asyncio
import functools
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cobali.frontend.errors import bad_request, unknown_model
from cobali.frontend.model_table import ModelStatus
from cobali.frontend.work_pool import client_of
from cobali.http.app import slot_row
from cobali.http.loaded_model import ModelApp
from cobali.http.model_router import ModelRouter, read_ref

router = APIRouter()
STARTED = int(time.time())


def _models(http: Request) -> ModelRouter:
    return http.app.state.models


@router.get("/health")
async def health() -> JSONResponse:
    """The endpoint is up: models load on demand, so none need be loaded (GET /models says which are)."""
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(generate_latest(_models(http).registry), media_type=CONTENT_TYPE_LATEST)


def _card(models: ModelRouter, status: ModelStatus) -> dict:
    card: dict = {"id": status.name, "object": "model", "created": STARTED, "owned_by": "cobali"}
    model = models.table.loaded(status.name)
    if isinstance(model, ModelApp):
        card["max_model_len"] = model.context.client.model_info.max_model_len
    return card


@router.get("/v1/models")
async def openai_models(http: Request) -> dict:
    models = _models(http)
    return {"object": "list", "data": [_card(models, status) for status in models.table.statuses()]}


@router.get("/v1/models/{model_id:path}")
async def openai_model(model_id: str, http: Request) -> dict:
    models = _models(http)
    statuses = {status.name: status for status in models.table.statuses()}
    if model_id not in statuses:
        raise unknown_model(model_id, ", ".join(list(statuses)[:10]))
    return _card(models, statuses[model_id])


@router.get("/models")
async def router_models(http: Request) -> dict:
    """llama-server's router list: each model's state, with what cobali knows besides (memory, pin, load)."""
    models = _models(http)
    data = [{**_card(models, status), "status": {"value": status.state},
             "bytes": status.bytes, "pinned": status.pinned, "in_flight": status.in_flight,
             "waiting": status.waiting, "loaded_for_s": status.loaded_for_s, "idle_for_s": status.idle_for_s,
             "expires_in_s": status.expires_in_s, "error": status.error} for status in models.table.statuses()]
    return {"object": "list", "data": data,
            "memory": {"budget_bytes": models.config.policy.memory_bytes,
                       "resident_bytes": models.table.resident_bytes()}}


async def _named(http: Request) -> str:
    models = _models(http)
    ref = await models.pool.run(client_of(http), functools.partial(read_ref, await http.body()))
    if ref.model is None:
        raise bad_request("name the model to load or unload", "model")
    if ref.model not in models.table:
        raise unknown_model(ref.model, ", ".join(models.served)[:200])
    return ref.model


@router.post("/models/load")
async def load(http: Request) -> dict:
    name = await _named(http)
    await _models(http).table.load(name, client_of(http))
    return {"success": True}


@router.post("/models/unload")
async def unload(http: Request) -> dict:
    name = await _named(http)
    await _models(http).table.unload(name)
    return {"success": True}


@router.get("/slots")
async def slots(http: Request) -> list[dict]:
    loaded = list(_models(http).loaded())
    states = await asyncio.gather(*(context.client.slot_states() for _, context in loaded))
    return [{"model": name, **slot_row(slot)} for (name, _), slots in zip(loaded, states, strict=True)
            for slot in slots]
