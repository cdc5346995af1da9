"""Several engines behind one OpenAI-compatible endpoint, with Ray Serve.

    cobali serve --replicas 2 --threads 1 --port 8000 [--ray-address ADDR]
    serve run cobali.ray.serve:build replicas=2 threads=1 max-slots=8     # the same application, by Ray's CLI

Each engine is a deployment of its own (`cobali-engine-<i>`, one replica) hosting the single server's app;
a gateway deployment is the HTTP ingress. One deployment per engine, rather than one deployment of N
replicas, is what lets the gateway address each engine: it routes every request to the least busy one and
asks all of them for /metrics, /health and /slots.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import threading
from collections.abc import AsyncIterator

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Message

from cobali.config.flags import engine_setup
from cobali.config.serve_flags import add_serve_args, server_config
from cobali.engine.setup import EngineSetup
from cobali.frontend.client import EngineState
from cobali.http.config import ServerConfig
from cobali.http.serve import build_app, configure_logging, warn_if_open
from cobali.ray.asgi import HTTPRequest, call_app
from cobali.ray.gateway import gateway_app

log = logging.getLogger("cobali.http")
APP_NAME = "cobali"
HEADROOM = 16  # calls an engine takes beyond its queue limit, so /health, /metrics, /slots never wait behind it


class EngineReplica:
    """One engine: the single server's app, with its engine thread, run in-process per request (a deployment
    once build_application wraps it)."""

    # Ray Serve awaits an async constructor, which Python's typing has no way to say.
    async def __init__(self, spec: EngineSetup, settings: ServerConfig) -> None:  # type: ignore[misc]
        configure_logging()  # a fresh process: Ray only sets up its own loggers
        self.app = build_app(spec, settings)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread, which loads the model
        self._thread = self.app.state.server.client
        while self._thread.state is EngineState.LOADING:  # ready once loaded: serve.run waits for that
            await asyncio.sleep(0.05)
        self.check_health()

    async def handle(self, request: HTTPRequest) -> AsyncIterator[Message]:
        async for message in call_app(self.app, request):
            yield message

    def check_health(self) -> None:
        """Called by Ray Serve every few seconds: a failed engine gets its replica replaced."""
        if self._thread.state is EngineState.FAILED:
            raise RuntimeError(f"the engine failed: {self._thread.error}")

    async def __del__(self) -> None:
        # Ray Serve calls this after in-flight requests finished or graceful_shutdown_timeout_s passed.
        await self._lifespan.__aexit__(None, None, None)


class RayEngine:
    """An engine as the gateway sees it: a request in, the app's ASGI messages streamed back."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle.options(stream=True)

    async def messages(self, request: HTTPRequest) -> AsyncIterator[Message]:
        stream = self._handle.handle.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)  # what a handle with stream=True returns
        finished = False
        try:
            async for message in stream:
                yield message
            finished = True
        finally:
            if not finished:  # the client left: cancelling the replica's generator frees its slot
                stream.cancel()


@serve.ingress()
class Gateway:
    def __init__(self, engines: list[DeploymentHandle], settings: ServerConfig) -> None:
        self._engines = [RayEngine(handle) for handle in engines]
        self._settings = settings

    def __serve_build_asgi_app__(self) -> FastAPI:
        return gateway_app(self._engines, self._settings)


def cpus_per_replica(spec: EngineSetup) -> int:
    return spec.backend.n_threads or 1


def build_application(spec: EngineSetup, settings: ServerConfig) -> Application:
    # Ray must not queue in front of an engine: beyond slots + --max-queue its app answers 429 itself.
    assert settings.max_queue is not None, "serve's --max-queue is always a number"
    per_engine = spec.engine.max_slots + settings.max_queue + HEADROOM
    # serve.deployment(...)(cls), not a class decorator: a type checker keeps a decorated class a class.
    engine = serve.deployment(max_ongoing_requests=per_engine, graceful_shutdown_timeout_s=settings.shutdown_grace_s,
                              ray_actor_options={"num_cpus": cpus_per_replica(spec)},
                              max_constructor_retry_count=1)(EngineReplica)  # a model that fails to load fails again
    # CORS and the connection caps are the gateway's, which sees every request; a replica still checks the key,
    # which names its prefix cache's tenant (cobali.http.auth).
    behind = dataclasses.replace(settings, allowed_origins=(), max_connections=None, max_connections_per_client=None)
    engines = [engine.options(name=f"cobali-engine-{i}").bind(spec, behind) for i in range(settings.replicas)]
    gateway = serve.deployment(ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=settings.replicas * per_engine)(Gateway)
    return gateway.bind(engines, settings)


def build(options: dict[str, str]) -> Application:
    """For `serve run cobali.ray.serve:build key=value ...`: the keys are `cobali serve`'s flags (max-slots=8,
    kv-unified=true); --host and --port are Ray Serve's own (serve run --address, the HTTP options)."""
    argv = []
    for key, value in options.items():
        argv.append(f"--{key.replace('_', '-')}")
        if str(value).lower() != "true":  # a bare switch
            argv.append(str(value))
    parser = argparse.ArgumentParser(prog="cobali.ray.serve:build")
    add_serve_args(parser)
    args = parser.parse_args(argv)
    return build_application(engine_setup(args, record_ticks=False), server_config(args))  # as `cobali serve`


def serve_replicas(spec: EngineSetup, settings: ServerConfig) -> int:
    """Bad flag combinations failed when the configs were built, before a cluster starts."""
    configure_logging()
    warn_if_open(settings)
    local = settings.ray_address is None
    if local:
        ray.init(address="local", include_dashboard=False)  # the endpoint has its own /metrics
    else:
        ray.init(address=settings.ray_address)
    try:
        each = cpus_per_replica(spec)
        needed, available = settings.replicas * each, ray.cluster_resources().get("CPU", 0)
        if local and needed > available:  # Ray would wait for CPUs forever
            raise ValueError(f"--replicas {settings.replicas} need {needed} CPUs ({each} each, "
                             f"from --threads); this machine has {available:g}")
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(build_application(spec, settings), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:  # an engine failed to start (its error is in the message)
            log.error("exiting: %s", err)
            return 1
        log.info("serving on http://%s:%d: %d replicas", settings.host, settings.port, settings.replicas)
        _wait_for_signal()
        return 0
    finally:
        # Serve drains each replica (up to --shutdown-grace) before stopping it; a shared cluster keeps
        # everything else it runs.
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
        ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: stop.set())
    while not stop.wait(1.0):  # a timed wait, so the handler always gets to run
        pass
