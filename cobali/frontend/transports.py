"""Where an engine core runs, and how messages travel to it and back. On a thread of this process (ThreadCore):
the messages are passed as they are. In a process of its own (engine_process.py): msgpack over local sockets,
and a crash of the engine costs a restart, not the server."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from cobali.engine.core import EngineCore, settle_heap
from cobali.engine.engine import Engine
from cobali.engine.messages import Failed, FromCore, ToCore
from cobali.engine.tokenizer import Tokenizer
from cobali.structured.compiler import GrammarCompiler

log = logging.getLogger("cobali.http")


class Listener(Protocol):
    """What a transport tells its client (cobali.frontend.client.EngineClient)."""

    def receive(self, message: FromCore) -> None: ...

    def core_lost(self, why: str) -> None: ...


@runtime_checkable
class Transport(Protocol):
    tokenizer: Tokenizer  # the model's text side and the constraints' compiler, in this process: set before Ready
    grammars: GrammarCompiler

    def start(self, listener: Listener) -> None:
        """Load the engine; its messages, Ready first (or Failed), then go to the listener."""

    def send(self, message: ToCore) -> None:
        """Thread-safe; a message sent before the engine is ready waits for it."""

    def stop(self, timeout_s: float) -> None:
        """After a Shutdown was sent: wait for the core to end (at most timeout_s), then free what is left."""


class ThreadCore:
    """The core on a thread of this process: outputs reach the listener on the engine's own threads."""

    def __init__(self, factory: Callable[[], Engine]) -> None:
        self._factory = factory
        self.engine: Engine | None = None  # once loaded; for this process's tests and benchmarks alone
        self._inbox: deque[ToCore] = deque()  # append and popleft are atomic
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cobali-engine", daemon=True)

    def start(self, listener: Listener) -> None:
        self._listener = listener
        self._thread.start()

    def send(self, message: ToCore) -> None:
        self._inbox.append(message)
        self._wake.set()

    def stop(self, timeout_s: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _receive(self, timeout_s: float) -> list[ToCore]:
        if not self._inbox and timeout_s > 0:
            self._wake.wait(timeout_s)
        self._wake.clear()  # before the inbox is read: a message sent after it wakes the next wait
        messages = []
        while self._inbox:
            messages.append(self._inbox.popleft())
        return messages

    def _run(self) -> None:
        listener = self._listener
        try:
            engine = self._factory()
        except Exception as err:
            listener.receive(Failed(f"loading failed: {err}", loading=True))
            return
        self.engine, self.tokenizer, self.grammars = engine, engine.tokenizer, engine.grammars
        with contextlib.suppress(NotImplementedError):  # a backend that takes no constraints
            _ = engine.grammars.tokenizer  # the vocabulary read now, not on a first constraint: that holds the GIL
        settle_heap()
        core = EngineCore(engine, listener.receive)
        core.announce()
        try:
            core.run(self._receive)
        except Exception as err:
            log.exception("the engine thread crashed")
            listener.receive(Failed(f"{type(err).__name__}: {err}"))
