"""What stands between a client and the routes, on every HTTP front door: the single server's app, and under Ray
Serve the gateway's (whose replicas check the key again: it names the cache's tenant, cobali.http.auth).

Outermost first: CORS, so a preflight is answered without a key and every error has CORS headers;
AnthropicErrors, so every error below it takes Anthropic's shape on /v1/messages; the connection caps and the key,
both from the request's headers alone; then BodyLimit, the first to read the body.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from cobali.http.anthropic_errors import AnthropicErrors
from cobali.http.auth import ApiKeyAuth
from cobali.http.body_limit import BodyLimit
from cobali.http.config import ServerConfig
from cobali.http.connections import ConnectionCaps


def add_front_door(app: FastAPI, config: ServerConfig) -> None:
    # Added innermost first: Starlette runs the last one added outermost.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=config.api_keys)
    if config.max_connections is not None or config.max_connections_per_client is not None:
        app.add_middleware(ConnectionCaps, overall=config.max_connections,
                           per_client=config.max_connections_per_client)
    app.add_middleware(AnthropicErrors)
    if config.allowed_origins:
        # Any request header: the OpenAI SDKs send Authorization and Content-Type, and the JS one X-Stainless-*
        # besides; the origin is the gate. No credentials: the key rides in a header, not a cookie.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
