"""Many models behind one endpoint (`cobali serve --models ...`): the front door (CORS, the connection caps, the key,
the body limit) is this app's; a request's body names its model, which the model table (cobali.frontend.
model_table) loads on demand, evicting others by memory; the request then goes to that model's own app
(cobali.http.loaded_model) as uvicorn would hand it over, and holds the model until its response is over.

The one-model server is untouched by this: no hop, no peek, no table."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator

import msgspec
from starlette.types import Message, Receive, Scope, Send

from cobali.frontend.cancels import Canceller
from cobali.frontend.errors import bad_request, unavailable
from cobali.frontend.model_table import Loaded, ModelTable, keep_alive_seconds
from cobali.frontend.work_pool import WorkPool, client_address
from cobali.http.disconnect import CLIENT_GONE, SCOPE_KEY, ClientWatch
from cobali.http.loaded_model import BuildApp, ModelApp, load_model
from cobali.http.model_metrics import ModelsCollector, models_registry
from cobali.http.models_config import ModelsConfig
from cobali.http.state import ServerContext

# The routes whose body names a model: every one a model's own app serves.
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/messages",
                "/v1/messages/count_tokens", "/v1/responses", "/tokenize", "/detokenize", "/v1/load_lora_adapter",
                "/v1/unload_lora_adapter")


class ModelRef(msgspec.Struct):
    """What the router reads of a body: its model, and Ollama's keep_alive. The model's app reads the rest."""

    model: str | None = None
    keep_alive: str | float | None = None


def read_ref(body: bytes) -> ModelRef:
    """On the worker pool: linear in the body (msgspec skips what it does not need, in C); 400 for a body that
    is no JSON object, with the same words the model's app would use."""
    try:
        return msgspec.json.decode(body or b"{}", type=ModelRef)
    except msgspec.ValidationError as err:
        raise bad_request(f"invalid request body: {err}") from None
    except msgspec.DecodeError as err:
        raise bad_request(f"invalid JSON body: {err}") from None
    except RecursionError:
        raise bad_request("invalid JSON body: nested too deeply") from None


class ModelRouter:
    """What the router's routes share, hung on app.state.models."""

    def __init__(self, config: ModelsConfig, build: BuildApp) -> None:
        self.config = config
        self.served = {served.entry.name: served for served in config.models}
        self.pool = WorkPool(config.front.preprocess)
        self.table = ModelTable({name: s.entry for name, s in self.served.items()}, config.policy, self._load)
        self._build = build
        self.draining = False
        self.registry = models_registry(ModelsCollector(self.table, config.policy.memory_bytes, self.loaded))

    async def _load(self, name: str) -> Loaded:
        return await load_model(self.served[name], self._build, self.config.policy.load_timeout_s)

    def drain(self, grace_s: float) -> None:
        """On SIGTERM: no new request is taken, and each loaded model's in-flight ones get grace_s to finish."""
        self.draining = True
        for _, context in self.loaded():
            context.client.drain(grace_s)

    def loaded(self) -> Iterator[tuple[str, ServerContext]]:
        for name in self.served:
            model = self.table.loaded(name)
            if isinstance(model, ModelApp):
                yield name, model.context

    def name_of(self, model: str | None) -> str:
        """The model a request names; left out, the only one declared. 404 for a name not declared is the
        table's."""
        if model is not None:
            return model
        if len(self.served) == 1:
            return next(iter(self.served))
        raise bad_request(f"name the model: this server serves {', '.join(list(self.served)[:10])}", "model")

    def keep_alive(self, ref: ModelRef) -> float | None:
        if ref.keep_alive is None:
            return None
        try:
            return keep_alive_seconds(ref.keep_alive)
        except ValueError as err:
            raise bad_request(str(err), "keep_alive") from None


class Forward:
    """The ASGI endpoint of every model's route (Starlette hands a function a Request; this takes the raw call)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await forward(scope, receive, send)


async def forward(scope: Scope, receive: Receive, send: Send) -> None:
    """A model's request: its body's model loaded (or waited for, the client's disconnect noticed meanwhile),
    then the request handed to the model's app, the model held until the response is over."""
    router: ModelRouter = scope["app"].state.models
    if router.draining:
        raise unavailable("the server is shutting down")
    client = client_address(scope)
    body = await _whole_body(receive)  # BodyLimit's replay: at most --max-body-bytes, in one message
    ref = await router.pool.run(client, functools.partial(read_ref, body))
    name, keep_alive = router.name_of(ref.model), router.keep_alive(ref)
    watch = scope[SCOPE_KEY] = ClientWatch(receive)  # the model's app finds it there: one reader of receive
    cancel = Canceller()
    watch.on_gone(cancel)
    try:
        async with router.table.lease(name, client, keep_alive) as model:
            watch.forget(cancel)
            assert isinstance(model, ModelApp), model
            await model.app(scope, _replay(body, watch), send)
    except asyncio.CancelledError:
        if not cancel.was_ours():
            raise
        await send({"type": "http.response.start", "status": CLIENT_GONE, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    finally:
        watch.stop()


async def _whole_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, watch: ClientWatch) -> Receive:
    """The model's app's receive: the body once, then the disconnect once the watch has seen it (the watch is
    the channel's one reader)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.Event()
    watch.on_gone(gone.set)

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive
