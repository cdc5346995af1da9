"""The FastAPI app: lifespan around the engine thread, its middleware, and the operational routes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cobali.frontend.client import EngineClient, QueueFull
from cobali.frontend.errors import APIError, install_error_handlers, unavailable, unknown_model
from cobali.frontend.generation import EngineUnavailable, GenerationError
from cobali.frontend.interface import SlotState
from cobali.frontend.request_limits import OverLimit
from cobali.frontend.work_pool import WorkPool
from cobali.http.collector import serving_pace
from cobali.http.config import ServerConfig
from cobali.http.middleware import add_front_door
from cobali.http.parse import document_bodies
from cobali.http.prometheus import ServerMetrics
from cobali.http.routes import chat, completions, embeddings, lora, messages, responses, tokenize
from cobali.http.state import LoraNames, ServerContext

ops = APIRouter()


# The API's description is served as the API is, behind the key (cobali.http.auth): FastAPI's own docs routes are
# turned off.
docs = APIRouter(include_in_schema=False)


def _schema_url(http: Request) -> str:
    return http.scope.get("root_path", "").rstrip("/") + "/openapi.json"  # behind a proxy's prefix, as FastAPI's


@docs.get("/openapi.json")
async def openapi(http: Request) -> JSONResponse:
    return JSONResponse(http.app.openapi())


@docs.get("/docs")
async def swagger_ui(http: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=_schema_url(http), title=f"{http.app.title} - Swagger UI")


@docs.get("/redoc")
async def redoc(http: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url=_schema_url(http), title=f"{http.app.title} - ReDoc")


def _context(http: Request) -> ServerContext:
    return http.app.state.server


@ops.get("/health")
async def health(http: Request) -> JSONResponse:
    try:
        _context(http).client.require_engine()
    except EngineUnavailable as err:  # loading, failed or draining: take this replica out of rotation
        return unavailable(str(err)).response()
    return JSONResponse({"status": "ok"})


@ops.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(_context(http).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(server: ServerContext, model_id: str) -> dict:
    """The base model's card, or (vLLM's) an adapter's, whose parent is the base model."""
    card: dict = {"id": model_id, "object": "model", "created": server.created, "owned_by": "cobali"}
    if model_id != server.model_name:
        card["parent"] = server.model_name
    with contextlib.suppress(EngineUnavailable):  # loading, or gone: a card without it
        card["max_model_len"] = server.client.model_info.max_model_len
    return card


@ops.get("/v1/models")
async def models(http: Request) -> dict:
    server = _context(http)
    return {"object": "list", "data": [_model_card(server, m) for m in (server.model_name, *server.loras.names())]}


@ops.get("/v1/models/{model_id:path}")
async def model(model_id: str, http: Request) -> dict:
    server = _context(http)
    if not server.serves(model_id):
        raise unknown_model(model_id, server.model_name)
    return _model_card(server, model_id)


@ops.get("/slots")
async def slots(http: Request) -> list[dict]:
    return [slot_row(slot) for slot in await _context(http).client.slot_states()]


def slot_row(slot: SlotState) -> dict:
    return {"id": slot.id, "is_processing": slot.is_processing, "request_id": slot.request_id, "state": slot.state,
            "n_prompt_tokens": slot.n_prompt_tokens, "n_decoded": slot.n_decoded, "n_ctx_used": slot.n_ctx_used}


def create_app(config: ServerConfig, client: EngineClient) -> FastAPI:
    """The app around an engine client built at the CLI edge (serve.build_app), which loads the model on its
    thread: the thread starts with the app, so /health answers 503 while the model loads, and stops with it.
    config.served_model_name names the model (the CLI edge fills it in when the flag left it out); what one
    request may cost, who may call and how streams are held to their clients are config's too
    (docs/configuration.md, "Bounded cost")."""
    if config.served_model_name is None:
        raise ValueError("create_app needs the served model's name: ServerConfig.served_model_name")
    pool = WorkPool(config.preprocess)
    metrics = ServerMetrics()
    client.observer = metrics  # the app's /metrics report what this client's engine does

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        metrics.loop_lag.start()
        with serving_pace():  # the collector paced for bursts of short-lived objects (cobali.http.collector)
            yield
        await metrics.loop_lag.stop()
        await asyncio.to_thread(client.stop)  # joining must not block the loop it reports to
        pool.close()

    # FastAPI's own OpenTelemetry hooks look up the tracer provider in os.environ on every request, a share of
    # the event loop's time that grows with the streams (bench/engine/sleeping_backend.py); cobali's metrics are
    # /metrics.
    app = FastAPI(title="cobali", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False},
                  openapi_url=None, docs_url=None, redoc_url=None)  # the `docs` router's instead
    app.state.server = ServerContext(config, client, metrics, pool,
                                     LoraNames(tuple(name for name, _ in config.lora_modules)), int(time.time()))
    install_error_handlers(app)
    add_front_door(app, config)  # CORS, the connection caps and the key, before BodyLimit reads a body

    @app.exception_handler(GenerationError)
    async def _generation_error(_http: Request, err: GenerationError) -> JSONResponse:
        return err.api_error().response()

    @app.exception_handler(QueueFull)
    async def _queue_full(_http: Request, err: QueueFull) -> JSONResponse:
        return APIError(429, str(err), "rate_limit_error", code="queue_full").response()

    @app.exception_handler(OverLimit)
    async def _over_limit(_http: Request, err: OverLimit) -> JSONResponse:
        return APIError(400, str(err), param=err.param, code="over_limit").response()

    # The generating routes first: the router tries each route in turn, and these take nearly every request.
    for routes in (completions, chat, embeddings, responses, messages, tokenize, *[lora] * config.runtime_lora):
        app.include_router(routes.router)
    app.include_router(ops)
    app.include_router(docs)
    document_bodies(app)  # the routes parse their own bodies (parse.py): their schemas are added here
    return app
