"""An engine core in a process of its own: the frontend's messages come in on one local socket, the core's go out
on another, msgpack both ways (messages.py). The frontend starts it (cobali/frontend/engine_process.py), and
starts another when it dies; it ends on a Shutdown, or by itself once the frontend's process is gone. A server of
many models starts one ahead of need as a spare (serve_spare), which becomes an engine when a load comes.

Each names its process (Linux's comm: `ps`, `top`): an engine "cobali-engine", a spare "cobali-spare"."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import zmq

from cobali.engine.core import EngineCore, settle_heap
from cobali.engine.engine import Engine
from cobali.engine.messages import ENCODER, TO_CORE, Failed, FromCore, Shutdown, ToCore

log = logging.getLogger("cobali.engine")
LINGER_MS = 2000  # what the core sent last (its final outputs) still goes out for this long after it ends


def serve_core(factory: Callable[[], Engine], to_core: str, from_core: str) -> None:
    """The process's main: load the engine with `factory`, then serve messages until told to stop."""
    _name_process("cobali-engine")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("cobali").setLevel(logging.INFO)
    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # a tick's outputs never wait for, or are dropped by, a frontend behind
    inbox.connect(to_core)
    outbox.connect(from_core)
    lock = threading.Lock()  # the core sends from its ticking thread, its host thread and its embeddings thread

    def send(message: FromCore) -> None:
        data = ENCODER.encode(message)
        with lock:
            outbox.send(data, copy=False)

    try:
        _serve(factory, send, _receiver(inbox, os.getppid()))
    finally:
        inbox.close(linger=0)
        outbox.close(linger=LINGER_MS)
        context.term()


def serve_spare(work: Connection, preload: tuple[str, ...]) -> None:
    """A spare's main (cobali.frontend.engine_process.SparePool): the modules an engine's process needs,
    imported ahead of need; then, blocked on `work` until a load comes, serve_core with the factory and the
    sockets sent there. It ends unused once `work` is closed: the pool stopped, or the frontend's process is gone."""
    _name_process("cobali-spare")
    for module in preload:
        importlib.import_module(module)
    try:
        factory, to_core, from_core = work.recv()
    except EOFError:
        return
    finally:
        work.close()
    serve_core(factory, to_core, from_core)


def _name_process(name: str) -> None:
    with contextlib.suppress(OSError):  # Linux's; elsewhere the process keeps its interpreter's name
        Path("/proc/self/comm").write_text(name)


def _serve(factory: Callable[[], Engine], send: Callable[[FromCore], None],
           receive: Callable[[float], list[ToCore]]) -> None:
    try:
        engine = factory()
    except Exception as err:
        send(Failed(f"loading failed: {err}", loading=True))
        return
    with contextlib.suppress(NotImplementedError):  # a backend that takes no constraints
        _ = engine.grammars.tokenizer  # the vocabulary read now, not on a first constraint: that holds the GIL
    settle_heap()
    core = EngineCore(engine, send)
    core.announce()
    try:
        core.run(receive)
    except Exception as err:
        log.exception("the engine crashed")
        send(Failed(f"{type(err).__name__}: {err}"))


def _receiver(inbox: zmq.Socket, parent: int) -> Callable[[float], list[ToCore]]:
    def receive(timeout_s: float) -> list[ToCore]:
        messages: list[ToCore] = []
        if inbox.poll(int(timeout_s * 1000)):
            while True:
                try:
                    data = inbox.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    messages.append(TO_CORE.decode(data.buffer))
                except msgspec.MsgspecError as err:  # the frontend's bug: the engine goes on without it
                    log.error("a message the engine cannot read was dropped: %s", err)
        if os.getppid() != parent:  # the frontend is gone (killed): nobody will read what this engine makes
            messages.append(Shutdown())
        return messages

    return receive
