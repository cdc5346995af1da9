"""The FastAPI app: lifespan around the engine thread, auth, and the operational routes."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cobali.engine.engine import Engine
from cobali.frontend.client import EngineThread, QueueFull
from cobali.frontend.errors import APIError, install_error_handlers, unavailable, unknown_model
from cobali.frontend.generation import EngineUnavailable, GenerationError
from cobali.frontend.request_limits import OverLimit, PreprocessLimits, RequestLimits
from cobali.frontend.work_pool import WorkPool
from cobali.http.body_limit import BodyLimit
from cobali.http.config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_STREAM_BUFFER_CHARS, DEFAULT_SEND_TIMEOUT_S
from cobali.http.parse import document_bodies
from cobali.http.prometheus import ServerMetrics
from cobali.http.routes import chat, completions, embeddings, lora, responses, tokenize
from cobali.http.state import LoraNames, ServerContext
from cobali.structured.limits import GrammarLimits

ops = APIRouter()


async def require_api_key(http: Request) -> None:
    """Bearer auth for /v1/*, /tokenize, /detokenize, /slots and the docs (/docs, /redoc, /openapi.json); /health
    and /metrics stay open for probes and scrapers. Async, because FastAPI runs a plain-def dependency on a worker
    thread: a thread hop per request."""
    keys = http.app.state.server.api_keys
    if not keys:
        return
    scheme, _, token = http.headers.get("authorization", "").partition(" ")
    given = token.strip().encode()
    # Every key compared, in constant time each: how long the check takes says nothing of which key matched.
    matches = [secrets.compare_digest(given, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")


# The API's description is served as the API is: FastAPI's own docs routes would answer without the key.
docs = APIRouter(include_in_schema=False, dependencies=[Depends(require_api_key)])


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
        _context(http).engine_thread.require_engine()
    except EngineUnavailable as err:  # loading, failed or draining: take this replica out of rotation
        return unavailable(str(err)).response()
    return JSONResponse({"status": "ok"})


@ops.get("/metrics")
async def metrics(http: Request) -> Response:
    return Response(_context(http).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _model_card(server: ServerContext, model_id: str) -> dict:
    """The base model's card, or (vLLM's) an adapter's, whose parent is the base model."""
    engine = server.engine_thread.engine
    card = {"id": model_id, "object": "model", "created": server.created, "owned_by": "cobali"}
    if model_id != server.model_name:
        card["parent"] = server.model_name
    if engine is not None:
        card["max_model_len"] = engine.backend.info.n_ctx_seq
    return card


@ops.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(http: Request) -> dict:
    server = _context(http)
    return {"object": "list", "data": [_model_card(server, m) for m in (server.model_name, *server.loras.names())]}


@ops.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])
async def model(model_id: str, http: Request) -> dict:
    server = _context(http)
    if not server.serves(model_id):
        raise unknown_model(model_id, server.model_name)
    return _model_card(server, model_id)


@ops.get("/slots", dependencies=[Depends(require_api_key)])
async def slots(http: Request) -> list[dict]:
    return slot_table(_context(http).engine_thread.require_engine())


def slot_table(engine: Engine) -> list[dict]:
    """Read from the event loop while the engine ticks: a snapshot, each row consistent enough to show."""
    by_slot = {r.slot: r for r in list(engine.scheduler.running) if r.slot is not None}
    rows = []
    for slot in range(engine.config.max_slots):
        request = by_slot.get(slot)
        rows.append({
            "id": slot,
            "is_processing": request is not None,
            "request_id": request.id if request else None,
            "state": request.state.value if request else "idle",
            "n_prompt_tokens": len(request.prompt_tokens) if request else 0,
            "n_decoded": len(request.output_tokens) if request else 0,
            "n_ctx_used": request.computed_tokens if request else 0,
        })
    return rows


def create_app(engine_factory: Callable[[], Engine], model_name: str, max_queue: int | None = None,
               api_keys: tuple[str, ...] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               chat_template: str | None = None, stream_interval: int = 1, lora_names: tuple[str, ...] = (),
               runtime_lora: bool = False, send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
               max_stream_buffer_chars: int = DEFAULT_MAX_STREAM_BUFFER_CHARS, limits: RequestLimits | None = None,
               grammar: GrammarLimits | None = None, preprocess: PreprocessLimits | None = None,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app and its engine thread, which builds the engine with `engine_factory` (loading the model).

    The thread starts with the app, so /health answers 503 while the model loads, and stops with it.
    lora_names: the adapters loaded with the model; runtime_lora: vLLM's load/unload routes are served.
    limits, grammar, preprocess: what one request may cost (README, "Bounded cost"); None: the defaults.
    api_keys: a request must bear one (none: open); allowed_origins: browser pages let in by CORS (none: no CORS).
    """
    pool = WorkPool(preprocess or PreprocessLimits())
    metrics = ServerMetrics()
    engine_thread = EngineThread(engine_factory, max_queue=max_queue, observer=metrics,
                                 stream_interval=stream_interval)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine_thread.start()
        metrics.loop_lag.start()
        yield
        await metrics.loop_lag.stop()
        await asyncio.to_thread(engine_thread.stop)  # joining must not block the loop it reports to
        pool.close()

    # FastAPI's own OpenTelemetry hooks look up the tracer provider in os.environ on every request (7.5 % of
    # the event loop's time at 256 streams, bench/sleeping_backend.py); cobali's metrics are its /metrics.
    app = FastAPI(title="cobali", lifespan=lifespan, telemetry={"tracing": False, "metrics": False, "logs": False},
                  openapi_url=None, docs_url=None, redoc_url=None)  # the `docs` router's instead
    app.state.server = ServerContext(engine_thread, metrics, model_name, api_keys, created=int(time.time()),
                                     chat_template=chat_template, loras=LoraNames(lora_names),
                                     send_timeout_s=send_timeout_s, max_stream_buffer_chars=max_stream_buffer_chars,
                                     limits=limits or RequestLimits(), grammar=grammar or GrammarLimits(), pool=pool)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if allowed_origins:  # added last, so outermost: a preflight never reaches the key check, and a 413 has CORS too
        # Any request header: the OpenAI SDKs send Authorization and Content-Type, and the JS one X-Stainless-*
        # besides; the origin is the gate. No credentials: the key rides in a header, not a cookie.
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.exception_handler(GenerationError)
    async def _generation_error(_http: Request, err: GenerationError) -> JSONResponse:
        return err.api_error().response()

    @app.exception_handler(QueueFull)
    async def _queue_full(_http: Request, err: QueueFull) -> JSONResponse:
        return APIError(429, str(err), "rate_limit_error", code="queue_full").response()

    @app.exception_handler(OverLimit)
    async def _over_limit(_http: Request, err: OverLimit) -> JSONResponse:
        return APIError(400, str(err), param=err.param, code="over_limit").response()

    app.include_router(ops)
    app.include_router(docs)
    for routes in (completions, chat, embeddings, responses, tokenize, *[lora] * runtime_lora):
        app.include_router(routes.router, dependencies=[Depends(require_api_key)])
    document_bodies(app)  # the routes parse their own bodies (parse.py): their schemas are added here
    return app
