"""vLLM's routes for LoRA adapters while serving (`cobali serve --allow-runtime-lora-updating`, as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter {lora_name, lora_path} serves a GGUF adapter as
model `lora_name`; POST /v1/unload_lora_adapter {lora_name} stops taking requests for it at once, and the engine
frees it when its last request ends. Both answer vLLM's plain-text "Success: ..." line.

Off by default: a client that may name files on the server's disk is an operator's decision.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from cobali.frontend.errors import APIError, bad_request
from cobali.frontend.interface import AdapterLimit
from cobali.http.parse import json_body, parse_body
from cobali.http.protocol.bodies import RequestBody
from cobali.http.state import ServerContext

router = APIRouter()
log = logging.getLogger("cobali.http")


class LoadLoraBody(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraBody(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name decides here


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoraBody))
async def load_lora_adapter(http: Request) -> PlainTextResponse:
    body = await parse_body(http, LoadLoraBody)
    server: ServerContext = http.app.state.server
    name, loras = body.lora_name, server.loras
    if server.serves(name) or name in loras.reserved:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    loading = server.client.load_adapter(body.lora_path)  # 503 unless ready
    loras.name_when_loaded(name, loading)
    try:
        await asyncio.shield(loading)  # a handler cancelled now still leaves the adapter its name
    except AdapterLimit as err:
        raise bad_request(f"Loading lora {name} failed: {err}") from None
    except (OSError, ValueError) as err:
        # One answer whether the file is missing, unreadable or no adapter (vLLM's 404 for a missing one would
        # tell a client which paths exist on the server's disk); the log says which.
        log.warning("loading lora %s failed: %s", name, err)
        raise bad_request(f"Loading lora {name} failed: {body.lora_path} is not a LoRA adapter this server can "
                          "load", "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoraBody))
async def unload_lora_adapter(http: Request) -> PlainTextResponse:
    body = await parse_body(http, UnloadLoraBody)
    server: ServerContext = http.app.state.server
    index = server.loras.index.get(body.lora_name)
    if index is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found_error",
                       "lora_name")
    unloading = server.client.unload_adapter(index)  # 503 unless ready
    del server.loras.index[body.lora_name]  # from now on no request names it
    await unloading
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
