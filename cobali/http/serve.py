"""Running the server: uvicorn around the app, with a graceful SIGTERM."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import math
import signal
import ssl
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from cobali.frontend.chat_template import JinjaChatTemplate
from cobali.frontend.client import EngineClient
from cobali.frontend.engine_process import ProcessCore, SparePool, model_text_side
from cobali.frontend.interface import EngineSetup
from cobali.frontend.transports import ThreadCore, Transport
from cobali.http.app import create_app
from cobali.http.config import ServerConfig
from cobali.http.models_config import ModelsConfig

log = logging.getLogger("cobali.http")


class DrainingServer(uvicorn.Server):
    """Stops admitting requests the moment a shutdown signal arrives; uvicorn then lets in-flight requests
    finish for up to timeout_graceful_shutdown before cancelling them."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def configure_logging() -> None:
    """INFO for cobali's own lines (per-request timings among them), in every process that runs a server."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # another name: it may resolve to any interface
        return False


def warn_if_open(settings: ServerConfig) -> None:
    """Loudly, for beyond loopback with no key: 0.0.0.0 is easy to type, and nothing else would say it."""
    if settings.api_keys or is_loopback(settings.host):
        return
    log.warning("NO API KEY: bound to %s, anyone who can reach port %d can use this server. Set a key with "
                "--api-key-file FILE (one a line) or COBALI_API_KEY, or bind to 127.0.0.1", settings.host,
                settings.port)


def serves_tls(settings: ServerConfig) -> bool:
    """Whether to serve HTTPS, the pair loaded once here first: a key that is not the certificate's, or a file
    that is no PEM, is then a CLI error naming them before the model loads, not uvicorn's traceback after."""
    if settings.ssl_certfile is None or settings.ssl_keyfile is None:
        return False
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
    except OSError as err:  # ssl.SSLError among them
        raise ValueError(f"--ssl-certfile {settings.ssl_certfile} with --ssl-keyfile {settings.ssl_keyfile}: "
                         f"{err}") from None
    return True


def build_app(spec: EngineSetup, server: ServerConfig, spares: SparePool | None = None) -> FastAPI:
    """The server's app from its configs, around an engine client that builds the engine from `spec` once the
    app starts; each Ray Serve replica hosts one too (cobali.ray.serve). spares: a server of many models' spare
    engine processes, for an engine in a process of its own."""
    model_name = server.served_model_name or spec.model_name()
    if server.chat_template is not None:
        JinjaChatTemplate(server.chat_template)  # a template that does not compile fails here, not per request
    if model_name in (name for name, _ in server.lora_modules):
        raise ValueError(f"--lora-modules: {model_name!r} is the base model's name")
    # The --grammar-* flags are the server's; the engine's compiler holds every constraint to them.
    spec = dataclasses.replace(spec, engine=dataclasses.replace(spec.engine, grammar_limits=server.grammar))
    server = dataclasses.replace(server, served_model_name=model_name)
    transport: Transport = ThreadCore(spec.build_engine)
    if server.engine_process:
        transport = ProcessCore(spec.build_engine, functools.partial(model_text_side, spec), spares=spares)
    return create_app(server, EngineClient(transport, max_queue=server.max_queue,
                                           stream_interval=server.stream_interval))


def serve(spec: EngineSetup, settings: ServerConfig) -> int:
    """Bad flag combinations failed when the configs were built, before the port is bound; the rest at load."""
    configure_logging()
    warn_if_open(settings)
    address = _address(settings)  # a TLS pair that does not load fails here, before anything is built
    app = build_app(spec, settings)
    client: EngineClient = app.state.server.client
    load_errors: list[str] = []
    server = _server(app, settings, on_exit=lambda: client.drain(settings.shutdown_grace_s))

    def load_failed(message: str) -> None:
        load_errors.append(message)
        server.should_exit = True

    client.on_load_failed = load_failed
    log.info("serving %s on %s (loading the model)", app.state.server.model_name, address)
    server.run()
    if load_errors:
        log.error("exiting: %s", load_errors[0])
        return 1
    return 0


def serve_models(config: ModelsConfig) -> int:
    """Many models behind one endpoint: each loads on demand in an engine process of its own."""
    from cobali.http.models_app import create_models_app  # only a server of many models needs the router

    configure_logging()
    settings = config.front
    warn_if_open(settings)
    address = _address(settings)
    spares = SparePool()  # an engine process started ahead of each load: a cold model's load skips its start
    try:
        app = create_models_app(config, functools.partial(build_app, spares=spares))
        server = _server(app, settings, on_exit=lambda: app.state.models.drain(settings.shutdown_grace_s))
        log.info("serving %s on %s (models load on demand)", ", ".join(m.entry.name for m in config.models),
                 address)
        server.run()
    finally:
        spares.stop()
    return 0


def _address(settings: ServerConfig) -> str:
    return f"{'https' if serves_tls(settings) else 'http'}://{settings.host}:{settings.port}"


def _server(app: FastAPI, settings: ServerConfig, on_exit: Callable[[], None]) -> DrainingServer:
    # The engine aborts what is left when the grace period ends, and the clients get a 503; uvicorn's own
    # timeout, which cancels handlers outright, is only a backstop.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            access_log=settings.access_log,
                            timeout_graceful_shutdown=math.ceil(settings.shutdown_grace_s) + 5,
                            ssl_certfile=settings.ssl_certfile, ssl_keyfile=settings.ssl_keyfile)
    # uvicorn re-raises the SIGTERM it caught once its shutdown is done, under the handler it found: make
    # that a no-op, since by then the shutdown was graceful and the exit status should be 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    return DrainingServer(config, on_exit=on_exit)
