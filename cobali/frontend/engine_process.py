"""The engine core in a process of its own (cobali/engine/process.py), as a transport: messages go to it as
msgpack over a local socket, and its messages come back on a thread of this process. The model's text side
(tokenizer, constraints' compiler) is this process's own: a vocabulary-only load.

When the engine's process dies, by any signal, the client is told (EngineClient.core_lost) and a new one is
started after a backoff that doubles with each death in a row; past `max_restarts` deaths within
`restart_window_s` the engine is failed for good, and /health says so."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from cobali.engine.engine import Engine
from cobali.engine.messages import ENCODER, FROM_CORE, Failed, FromCore, Ready, ToCore
from cobali.engine.process import serve_core
from cobali.engine.setup import EngineSetup
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.frontend.transports import Listener
from cobali.structured.compiler import GrammarCompiler

log = logging.getLogger("cobali.http")
TextSide = Callable[[ModelInfo], tuple[Tokenizer, GrammarCompiler]]
POLL_MS = 200  # how often the reading thread looks up from its sockets (a stop is noticed within it)


class ProcessCore:
    tokenizer: Tokenizer  # once the engine first said Ready
    grammars: GrammarCompiler

    def __init__(self, factory: Callable[[], Engine], text_side: TextSide, max_restarts: int = 5,
                 restart_window_s: float = 600.0, first_backoff_s: float = 0.5) -> None:
        """factory: builds the engine in the new process (picklable: a module-level function or a bound method
        of a config); text_side: this process's tokenizer and compiler for the model the engine loaded."""
        self._factory = factory
        self._text_side = text_side
        self.max_restarts, self.restart_window_s, self.first_backoff_s = max_restarts, restart_window_s, first_backoff_s
        self.restarts: list[float] = []  # when each death happened
        self._context = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="cobali-")  # the sockets' files
        self._send_lock = threading.Lock()  # the event loop sends; the reading thread swaps sockets on a restart
        self._stopping = False
        self._generation = 0
        self._reader = threading.Thread(target=self._read, name="cobali-engine-reader", daemon=True)

    def start(self, listener: Listener) -> None:
        self._listener = listener
        self._spawn()
        self._reader.start()

    def send(self, message: ToCore) -> None:
        data = ENCODER.encode(message)
        with self._send_lock:
            try:
                self._outbox.send(data, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no engine connected: it died (the client resends what had not started) or stopped
                log.debug("a message for an engine that is gone was dropped: %s", type(message).__name__)

    def stop(self, timeout_s: float) -> None:
        self._stopping = True
        self._process.join(timeout_s)
        if self._process.is_alive():
            log.warning("the engine's process did not stop within %.0f s: killed", timeout_s)
            self._process.kill()
            self._process.join(timeout_s)
        self._reader.join(timeout_s)
        self._close_sockets()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _spawn(self) -> None:
        self._generation += 1
        to_core, from_core = (f"ipc://{self._dir}/{name}-{self._generation}" for name in ("to", "from"))
        outbox, inbox = self._context.socket(zmq.PUSH), self._context.socket(zmq.PULL)
        outbox.setsockopt(zmq.SNDHWM, 0)  # no bound on what waits for a busy engine: a full queue would drop requests
        outbox.bind(to_core)
        inbox.bind(from_core)
        with self._send_lock:
            self._outbox, self._inbox = outbox, inbox
        spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        self._process = spawn.Process(target=serve_core, args=(self._factory, to_core, from_core),
                                      name="cobali-engine", daemon=True)
        self._process.start()

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._outbox.close(linger=0)
            self._inbox.close(linger=0)

    def _read(self) -> None:
        while True:
            poller = zmq.Poller()
            poller.register(self._inbox, zmq.POLLIN)
            poller.register(self._process.sentinel, zmq.POLLIN)
            ready = dict(poller.poll(POLL_MS))
            if self._inbox in ready:
                self._take_messages()
            elif self._process.sentinel in ready:  # dead, and everything it sent has been read
                if self._stopping or not self._restart():
                    return
            elif self._stopping and not self._process.is_alive():
                return

    def _take_messages(self) -> None:
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message: FromCore = FROM_CORE.decode(data.buffer)
            except msgspec.MsgspecError as err:
                log.error("a message from the engine could not be read: %s", err)
                continue
            if isinstance(message, Ready) and not hasattr(self, "tokenizer"):  # the vocabulary loads once
                self.tokenizer, self.grammars = self._text_side(message.model)
            self._listener.receive(message)

    def _restart(self) -> bool:
        """After the engine's process died: a new one, unless it died too often (then the engine has failed)."""
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < self.restart_window_s] + [now]
        self._process.join(1)  # its exit code, now that it is gone
        why = f"exit code {self._process.exitcode}"
        if len(self.restarts) > self.max_restarts:
            self._listener.receive(Failed(f"the engine's process died {len(self.restarts)} times in "
                                          f"{self.restart_window_s:.0f} s (last: {why}); not restarting it"))
            return False
        self._listener.core_lost(why)
        time.sleep(self.first_backoff_s * 2 ** (len(self.restarts) - 1))
        self._close_sockets()
        if not self._stopping:
            self._spawn()
        return not self._stopping


def model_text_side(setup: EngineSetup, model: ModelInfo) -> tuple[Tokenizer, GrammarCompiler]:
    """The text side of the model `setup` loads, for the frontend's process: a vocabulary-only load (a sixth of
    the model's memory, docs/results.md), and a compiler held to the engine's grammar limits."""
    from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary  # llama.cpp loads only when a model does

    vocabulary = LlamaCppVocabulary.load(setup.backend)
    return (Tokenizer(vocabulary, model.max_model_len, model.context_hint),
            GrammarCompiler(vocabulary.guidance_tokenizer, setup.engine.grammar_limits))
