"""One declared model, loaded: the one-model server's own app (its template, parsers, limits, metrics and worker
pool) around an engine in a process of its own, started and stopped by the model table (cobali.frontend.
model_table) instead of by uvicorn. The router hands it requests as uvicorn would."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI

from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.interface import EngineSetup
from cobali.frontend.model_table import Loaded, LoadFailed
from cobali.http.config import ServerConfig
from cobali.http.models_config import ServedModel
from cobali.http.state import ServerContext

log = logging.getLogger("cobali.http")
BuildApp = Callable[[EngineSetup, ServerConfig], FastAPI]  # cobali.http.serve.build_app


class ModelApp:
    """A loaded model: its app, running; bytes: the larger of the estimate and what its engine's process holds
    once loaded (its KV pages are touched only as they fill, so the process alone would read low at first)."""

    def __init__(self, app: FastAPI, lifespan: contextlib.AsyncExitStack, estimate: int) -> None:
        self.app = app
        self._lifespan = lifespan
        self._bytes = max(estimate, _resident_bytes(self.context.client.transport) or 0)

    @property
    def context(self) -> ServerContext:
        return self.app.state.server

    @property
    def bytes(self) -> int | None:
        return self._bytes

    def failed(self) -> bool:
        """Its engine failed for good (it died too often): the table should load it afresh."""
        return self.context.client.state is EngineState.FAILED

    async def close(self) -> None:
        await self._lifespan.aclose()


async def load_model(served: ServedModel, build: BuildApp, timeout_s: float) -> Loaded:
    """The model's app, started, once its engine says it is ready; LoadFailed if the engine failed to load or was
    not ready within timeout_s (its process is then stopped)."""
    started = time.monotonic()
    app = build(served.setup, served.server)
    client: EngineClient = app.state.server.client
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[None] = loop.create_future()

    def settle(error: str | None) -> None:  # on the client's receiving thread
        loop.call_soon_threadsafe(_settle, outcome, error)

    client.on_ready = lambda: settle(None)
    client.on_load_failed = settle
    lifespan = contextlib.AsyncExitStack()
    await lifespan.enter_async_context(app.router.lifespan_context(app))
    try:
        await asyncio.wait_for(outcome, timeout_s)
    except BaseException as err:
        await lifespan.aclose()
        if isinstance(err, TimeoutError | asyncio.TimeoutError):
            raise LoadFailed(f"{served.entry.name}: not loaded within {timeout_s:g} s "
                             "(--models-load-timeout)") from None
        raise
    log.info("model %s loaded in %.1f s", served.entry.name, time.monotonic() - started)
    return ModelApp(app, lifespan, served.entry.bytes)


def _settle(outcome: asyncio.Future[None], error: str | None) -> None:
    if outcome.done():  # a later restart's Ready
        return
    if error is None:
        outcome.set_result(None)
    else:
        outcome.set_exception(LoadFailed(error))


def _resident_bytes(transport: object) -> int | None:
    """What the engine's process holds in memory now (Linux's VmRSS), or None where that cannot be read."""
    pid = getattr(transport, "pid", None)
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
