"""The engine core in a process of its own (cobali/engine/process.py), as a transport: messages go to it as
msgpack over a local socket, and its messages come back on a thread of this process. The model's text side
(tokenizer, constraints' compiler) is this process's own: a vocabulary-only load, on a thread of its own while the
engine's process loads, bound to the model once the engine says Ready.

When the engine's process dies, by any signal, the client is told (EngineClient.core_lost) and a new one is
started after a backoff that doubles with each death in a row; past `max_restarts` deaths within
`restart_window_s` the engine is failed for good, and /health says so.

A server of many models keeps a spare engine process (SparePool): started ahead of need, it has imported what an
engine's process imports, and waits for its work; a load, or a restart, takes it instead of starting a process."""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec
import zmq

from cobali.engine.engine import Engine
from cobali.engine.messages import ENCODER, FROM_CORE, Failed, FromCore, Ready, ToCore
from cobali.engine.process import serve_core, serve_spare
from cobali.engine.setup import EngineSetup
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.frontend.transports import Listener
from cobali.structured.compiler import GrammarCompiler

log = logging.getLogger("cobali.http")
TextSide = Callable[[ModelInfo], tuple[Tokenizer, GrammarCompiler]]  # the fast part: binds to the engine's model
TextLoad = Callable[[], TextSide]  # the slow part (a vocabulary load): needs no engine, runs beside its load
POLL_MS = 200  # how often the reading thread looks up from its sockets (a stop is noticed within it)
SPAWN = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
# What a spare imports ahead of need: the factory's (EngineSetup.build_engine's) modules, llama_cpp among them.
PRELOAD = ("cobali.engine.setup", "cobali.backends.llama_cpp.backend")
# A load's spare is replaced this long after the load is over: a spare's start (half a second of a core) beside
# the new model's first request would delay its first token (by 0.15 s for the embedded model on 2 cores).
REFILL_AFTER_S = 1.0


class SparePool:
    """One spare engine process, for a server of many models (a one-model server has none): it has imported
    what an engine's process imports (`preload`), and waits, blocked on a pipe, for the factory and sockets of
    the engine it is to be. It is counted in no memory budget. A spare that died is replaced after the next load."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, refill_after_s: float = REFILL_AFTER_S) -> None:
        self._preload = preload
        self._refill_after_s = refill_after_s
        self._lock = threading.Lock()  # taken on the event loop and by readers' restarts; refilled by timers
        self._spare: tuple[BaseProcess, Connection] | None = None
        self._stopped = False
        self._refill()

    def take(self, factory: Callable[[], Engine], to_core: str, from_core: str) -> BaseProcess | None:
        """The spare, set to work as this engine (serve_core); None when there is none alive."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return None
        process, work = spare
        try:
            work.send((factory, to_core, from_core))  # a kB or so: the pipe holds it while the spare imports
        except BrokenPipeError:  # it died waiting
            process.join()
            return None
        finally:
            work.close()
        return process

    def load_over(self) -> None:
        """A load that may have taken the spare is over (its engine said Ready or Failed): the spare is replaced
        soon, not when it is taken, since its start would slow the load it ran beside."""
        timer = threading.Timer(self._refill_after_s, self._refill)
        timer.daemon = True
        timer.start()

    def _refill(self) -> None:
        """A new spare unless one is alive (a dead one is reaped) or the pool stopped."""
        with self._lock:
            if self._stopped or (self._spare is not None and self._spare[0].is_alive()):
                return
            dead, self._spare = self._spare, self._spawn()
        if dead is not None:
            dead[1].close()
            dead[0].join()

    def stop(self, timeout_s: float = 5.0) -> None:
        """With the server: the spare ends (it holds nothing yet), and none is started after."""
        with self._lock:
            self._stopped = True
            spare, self._spare = self._spare, None
        if spare is not None:
            spare[1].close()
            spare[0].terminate()
            spare[0].join(timeout_s)

    def _spawn(self) -> tuple[BaseProcess, Connection]:
        receive, send = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(target=serve_spare, args=(receive, self._preload), name="cobali-engine", daemon=True)
        process.start()
        receive.close()  # the spare's alone now: its wait ends (EOFError) once `send` closes, here or by our exit
        return process, send


class ProcessCore:
    tokenizer: Tokenizer  # once the engine first said Ready
    grammars: GrammarCompiler

    def __init__(self, factory: Callable[[], Engine], text_side: TextLoad, max_restarts: int = 5,
                 restart_window_s: float = 600.0, first_backoff_s: float = 0.5,
                 spares: SparePool | None = None) -> None:
        """factory: builds the engine in the new process (picklable: a module-level function or a bound method
        of a config); text_side: loads what this process's tokenizer and compiler need (on a thread, while the
        engine loads), and returns what makes them for the model the engine loaded; spares: where a new engine
        process is taken from, when one waits there."""
        self._factory = factory
        self._text_side = text_side
        self._text: Future[TextSide] = Future()
        self._text_loader = threading.Thread(target=self._load_text_side, name="cobali-vocabulary", daemon=True)
        self._spares = spares
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
        self._text_loader.start()
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
        self._text_loader.join(timeout_s)  # no llama.cpp load left running as the interpreter exits
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
        process = self._spares.take(self._factory, to_core, from_core) if self._spares is not None else None
        if process is None:
            process = SPAWN.Process(target=serve_core, args=(self._factory, to_core, from_core),
                                    name="cobali-engine", daemon=True)
            process.start()
        self._process: BaseProcess = process

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
            if isinstance(message, Ready) and not hasattr(self, "tokenizer"):  # the vocabulary binds once
                message = self._bind_text_side(message)
            self._listener.receive(message)
            if self._spares is not None and isinstance(message, Ready | Failed):  # a load is over
                self._spares.load_over()

    def _load_text_side(self) -> None:
        try:
            self._text.set_result(self._text_side())
        except Exception as err:  # told as the load's failure once the engine is ready (_bind_text_side)
            self._text.set_exception(err)

    def _bind_text_side(self, ready: Ready) -> Ready | Failed:
        """The engine's Ready once this process's text side is ready too; a text side that failed fails the load."""
        try:
            self.tokenizer, self.grammars = self._text.result()(ready.model)
        except Exception as err:
            log.exception("the model's vocabulary could not be loaded here")
            return Failed(f"loading failed: the frontend's vocabulary: {err}", loading=True)
        return ready

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


def model_text_side(setup: EngineSetup) -> TextSide:
    """The text side of the model `setup` loads, for the frontend's process: a vocabulary-only load (a sixth of
    the model's memory, docs/results.md), which needs no engine; then, once the engine has said what model it
    loaded, a tokenizer to its limits and a compiler held to the engine's grammar limits."""
    from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary  # llama.cpp loads only when a model does

    vocabulary = LlamaCppVocabulary.load(setup.backend)

    def bind(model: ModelInfo) -> tuple[Tokenizer, GrammarCompiler]:
        return (Tokenizer(vocabulary, model.max_model_len, model.context_hint),
                GrammarCompiler(vocabulary.guidance_tokenizer, setup.engine.grammar_limits))

    return bind
