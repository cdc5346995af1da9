"""vLLM's routes for LoRA adapters while serving (`cobali serve --allow-runtime-lora-updating`, as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): POST /v1/load_lora_adapter {lora_name, lora_path} serves a GGUF adapter as
model `lora_name`; POST /v1/unload_lora_adapter {lora_name} stops taking requests for it at once, and the engine
frees it when its last request ends. Both answer vLLM's plain-text "Success: ..." line.

Off by default: a client that may name files on the server's disk is an operator's decision.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from cobali.server.bodies import Body
from cobali.server.errors import APIError, bad_request
from cobali.server.state import ServerContext

router = APIRouter()


class LoadLoraBody(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraBody(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name decides here


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, http: Request) -> PlainTextResponse:
    server: ServerContext = http.app.state.server
    name, loras = body.lora_name, server.loras
    if server.serves(name) or name in loras.reserved:
        raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    loras.reserved.add(name)
    try:
        index = await server.engine_thread.call(lambda engine: engine.adapters.load(body.lora_path))
    except ValueError as err:
        raise bad_request(str(err), "lora_path") from None
    finally:
        loras.reserved.discard(name)
    loras.index[name] = index
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, http: Request) -> PlainTextResponse:
    server: ServerContext = http.app.state.server
    index = server.loras.index.pop(body.lora_name, None)  # from now on no request names it
    if index is None:
        raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "not_found_error",
                       "lora_name")
    await server.engine_thread.call(lambda engine: engine.adapters.unload(index))
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
