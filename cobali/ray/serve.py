"""Several engines behind one OpenAI-compatible endpoint, with Ray Serve.

    cobali serve --replicas 2 --threads 1 --port 8000 [--ray-address ADDR]
    cobali serve --min-replicas 1 --max-replicas 4 --threads 1      # autoscaled by Ray Serve
    serve run cobali.ray.serve:build replicas=2 threads=1 max-slots=8     # the same application, by Ray's CLI

One deployment of N engine replicas (`cobali-engine`: a fixed num_replicas, or Ray Serve's autoscaling_config),
each hosting the single server's app; an ingress deployment (`Ingress`, cobali.ray.gateway) is the HTTP front
door. The ingress calls the engine deployment through its handle, whose request router is ours
(cobali.ray.router: the deployment's request_router_config names it), with a routing hint per request; each
replica reports what its prefix cache holds (record_routing_stats, every --routing-stats-period).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve import context as serve_context
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.types import Message

from cobali.config.flags import engine_setup
from cobali.config.serve_flags import add_serve_args, server_config
from cobali.engine.setup import EngineSetup
from cobali.engine.views import ModelInfo
from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.inputs import InputProcessor
from cobali.http.config import ServerConfig
from cobali.http.serve import build_app, configure_logging, warn_if_open
from cobali.ray.asgi import REPLICA_MESSAGE, HTTPRequest, call_app
from cobali.ray.gateway import gateway_app
from cobali.ray.hints import Hinter
from cobali.ray.policy import Policy, PolicyConfig, RoutingHint, policy_of
from cobali.ray.router import HINT, CobaliRouter

log = logging.getLogger("cobali.http")
APP_NAME = "cobali"
ENGINES = "cobali-engine"  # the engine deployment's name
HEADROOM = 16  # calls an engine takes beyond its queue limit, so /health, /metrics, /slots never wait behind it


class EngineReplica:
    """One engine: the single server's app, with its engine thread, run in-process per request (a deployment
    once build_application wraps it)."""

    # Ray Serve awaits an async constructor, which Python's typing has no way to say.
    async def __init__(self, spec: EngineSetup, settings: ServerConfig,  # type: ignore[misc]
                       routing: PolicyConfig) -> None:
        configure_logging()  # a fresh process: Ray only sets up its own loggers
        self.app = build_app(spec, settings)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the engine thread, which loads the model
        self._client: EngineClient = self.app.state.server.client
        self._routing = routing
        self._reports = 0
        self._id = serve.get_replica_context().replica_id.unique_id
        while self._client.state is EngineState.LOADING:  # ready once loaded: serve.run waits for that
            await asyncio.sleep(0.05)
        self.check_health()

    async def handle(self, request: HTTPRequest, hint: RoutingHint | None = None) -> AsyncIterator[Message]:
        """The request through the app: first this replica's id, then the app's messages. `hint` is the
        router's (cobali.ray.router), which reads it from the call; unused here."""
        yield {"type": REPLICA_MESSAGE, "replica": self._id}
        async for message in call_app(self.app, request):
            yield message

    def model_info(self) -> ModelInfo:
        """The loaded model, as the ingress prepares routing hints for it."""
        return self._client.model_info

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray Serve every --routing-stats-period: what the router reads (cobali.ray.policy.report).
        An engine that cannot answer (loading, restarting) reports holding nothing: a restart lost its KV."""
        self._reports += 1
        stats: dict[str, Any] = {"seq": self._reports, "at": time.time(), "hashes": [], "kv_use": 0.0}
        if self._routing.policy != "kv":
            return stats
        try:
            report = await self._client.routing_report(self._routing.routing.block_tokens,
                                                       self._routing.routing.max_blocks)
        except Exception as err:  # the engine's own refusal (not ready), or its process gone
            log.debug("no routing report: %s", err)
            return stats
        return {**stats, "hashes": report.hashes, "kv_use": report.kv_use, "waiting_tokens": report.waiting_tokens}

    def check_health(self) -> None:
        """Called by Ray Serve every few seconds: a failed engine gets its replica replaced."""
        if self._client.state is EngineState.FAILED:
            raise RuntimeError(f"the engine failed: {self._client.error}")

    async def __del__(self) -> None:
        # Ray Serve calls this after in-flight requests finished or graceful_shutdown_timeout_s passed.
        await self._lifespan.__aexit__(None, None, None)


def _own_call_id() -> contextvars.Token:
    """Ray Serve names each call by its request's internal id, and its router hands a chosen replica to the call of
    that id: two calls at once from one request (the ingress asks every replica for /metrics) would leave one
    waiting for ever (Ray 2.60). So each call gets an id of its own, until the token is reset."""
    context = serve_context._get_serve_request_context()  # noqa: SLF001
    fresh = dataclasses.replace(context, _internal_request_id=uuid.uuid4().hex)
    return serve_context._serve_request_context.set(fresh)  # type: ignore[arg-type]  # noqa: SLF001


class RayReplicas:
    """The engine deployment as the ingress sees it (cobali.ray.gateway.Replicas): calls through its handle,
    routed by this process's CobaliRouter."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._stream = handle.options(stream=True)

    def ids(self) -> Sequence[str]:
        policy = self.policy()
        return policy.replicas if policy is not None else ()

    def policy(self) -> Policy | None:
        return policy_of(ENGINES)

    async def model_info(self) -> ModelInfo:
        return await self._handle.model_info.remote()

    async def messages(self, request: HTTPRequest, hint: RoutingHint) -> AsyncIterator[Message]:
        own = _own_call_id()
        try:
            stream = self._stream.handle.remote(request, **{HINT: hint})
        finally:
            serve_context._serve_request_context.reset(own)  # noqa: SLF001
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
class Ingress:
    """The HTTP front door (cobali.ray.gateway). Routing hints need the model's text side: a vocabulary-only
    load here, bound to the model a replica loaded; until both are done, requests route on load alone."""

    async def __init__(self, engines: DeploymentHandle, spec: EngineSetup,  # type: ignore[misc]
                       settings: ServerConfig, routing: PolicyConfig) -> None:
        configure_logging()
        self._replicas = RayReplicas(engines)
        self._settings = settings
        self._hinter: Hinter | None = None
        self._loading = asyncio.get_running_loop().create_task(self._load_hinter(spec, routing))

    async def _load_hinter(self, spec: EngineSetup, routing: PolicyConfig) -> None:
        # The first call through the handle: it starts this process's router, which then lists the replicas.
        model = await self._replicas.model_info()
        inputs = None
        if routing.policy in ("kv", "text"):
            from cobali.frontend.engine_process import model_text_side  # loads llama.cpp

            try:
                tokenizer, grammars = (await asyncio.to_thread(model_text_side, spec))(model)
            except Exception:
                log.exception("no routing hints: the model's vocabulary did not load")
                return
            s = self._settings
            inputs = InputProcessor(model, tokenizer, grammars, s.chat_template, s.reasoning_parser, s.tool_call_parser)
        self._hinter = Hinter(inputs, self._settings, routing.policy, routing.routing.block_tokens)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return gateway_app(self._replicas, self._settings, lambda: self._hinter)


def cpus_per_replica(spec: EngineSetup) -> int:
    return spec.backend.n_threads or 1


def scaling(settings: ServerConfig) -> dict[str, Any]:
    """The engine deployment's replicas: a fixed number, or Ray Serve's autoscaling between two."""
    if settings.max_replicas is None:
        return {"num_replicas": settings.replicas}
    autoscaling: dict[str, Any] = {"min_replicas": 1 if settings.min_replicas is None else settings.min_replicas,
                                   "max_replicas": settings.max_replicas}
    if settings.target_ongoing_requests is not None:
        autoscaling["target_ongoing_requests"] = settings.target_ongoing_requests
    return {"autoscaling_config": autoscaling}


def most_replicas(settings: ServerConfig) -> int:
    return settings.max_replicas or settings.replicas


def build_application(spec: EngineSetup, settings: ServerConfig) -> Application:
    # Ray must not queue in front of an engine: beyond slots + --max-queue its app answers 429 itself.
    assert settings.max_queue is not None, "serve's --max-queue is always a number"
    per_engine = spec.engine.max_slots + settings.max_queue + HEADROOM
    routing = PolicyConfig.from_settings(settings)
    router_options: dict[str, Any] = {"request_router_class": CobaliRouter,
                                      "request_router_kwargs": routing.as_kwargs(),
                                      "request_routing_stats_period_s": routing.routing.report_period_s}
    router = RequestRouterConfig(**router_options)
    # serve.deployment(...)(cls), not a class decorator: a type checker keeps a decorated class a class.
    engine = serve.deployment(name=ENGINES, max_ongoing_requests=per_engine, request_router_config=router,
                              graceful_shutdown_timeout_s=settings.shutdown_grace_s,
                              ray_actor_options={"num_cpus": cpus_per_replica(spec)},
                              max_constructor_retry_count=1,  # a model that fails to load fails again
                              **scaling(settings))(EngineReplica)
    # CORS and the connection caps are the ingress's, which sees every request; a replica still checks the key,
    # which names its prefix cache's tenant (cobali.http.auth).
    behind = dataclasses.replace(settings, allowed_origins=(), max_connections=None, max_connections_per_client=None)
    ingress = serve.deployment(ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=most_replicas(settings) * per_engine)(Ingress)
    return ingress.bind(engine.bind(spec, behind, routing), spec, settings, routing)


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


# A local cluster's Ray processes share the engines' CPUs. Serve's defaults are paced for clusters: its controller
# loops every 0.1 s and each replica and proxy exports metrics every 0.1 s. With these paces an idle two-replica
# deployment's Ray processes took 28 % less CPU (docs/results.md, issue 47's fifth part); the operator's own
# settings win.
LOCAL_SERVE_PACE = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}


def serve_replicas(spec: EngineSetup, settings: ServerConfig) -> int:
    """Bad flag combinations failed when the configs were built, before a cluster starts."""
    configure_logging()
    warn_if_open(settings)
    local = settings.ray_address is None
    if local:
        for name, value in LOCAL_SERVE_PACE.items():
            os.environ.setdefault(name, value)  # read by the controller, proxy and replicas Ray starts from here
        ray.init(address="local", include_dashboard=False)  # the endpoint has its own /metrics
    else:
        ray.init(address=settings.ray_address)
    try:
        each = cpus_per_replica(spec)
        most = most_replicas(settings)
        needed, available = most * each, ray.cluster_resources().get("CPU", 0)
        if local and needed > available:  # Ray would wait for CPUs forever
            flag = "--max-replicas" if settings.max_replicas is not None else "--replicas"
            raise ValueError(f"{flag} {most} need {needed} CPUs ({each} each, from --threads); this machine has "
                             f"{available:g}")
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(build_application(spec, settings), name=APP_NAME, route_prefix="/")
        except RuntimeError as err:  # an engine failed to start (its error is in the message)
            log.error("exiting: %s", err)
            return 1
        log.info("serving on http://%s:%d: %s replicas", settings.host, settings.port,
                 settings.replicas if settings.max_replicas is None else
                 f"{scaling(settings)['autoscaling_config']['min_replicas']} to {settings.max_replicas}")
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
