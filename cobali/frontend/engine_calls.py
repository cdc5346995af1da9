"""The questions a frontend asks its engine core beside the requests (messages.Call: its slots, a LoRA adapter to
load or unload, embeddings, a routing report), each answered between two ticks by a CallDone with the same id.
A call's future is settled on the event loop that asked, with the answer or the exception the engine raised; all
those still waiting fail at once when the engine goes."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from cobali.engine.adapters import AdapterLimit
from cobali.engine.messages import (
    CallDone,
    Embed,
    LoadAdapter,
    Question,
    ReadRoutingReport,
    ReadSlots,
    RoutingReport,
    UnloadAdapter,
)
from cobali.engine.views import SlotState
from cobali.frontend.generation import EngineUnavailable
from cobali.frontend.transports import Transport

T = TypeVar("T")


class EngineCalls(abc.ABC):
    """EngineClient's calls. The client says when the engine can answer (require_engine), under the lock that guards
    its state and the calls waiting together: a call is never left waiting by an engine that went meanwhile."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._lock = threading.Lock()  # the calls waiting, and the client's state beside them
        self._ids = itertools.count()  # the calls' ids, and the client's requests'
        self._calls: dict[int, asyncio.Future[CallDone]] = {}

    @abc.abstractmethod
    def require_engine(self) -> None:
        """EngineUnavailable unless the engine runs now."""

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings, one row per input (each within model_info.embeddings), computed beside the ticks."""
        done = await self._call(lambda call_id: Embed(call_id, inputs))
        return done.embeddings()

    def slot_states(self) -> asyncio.Future[tuple[SlotState, ...]]:
        """A snapshot of every slot, taken between two ticks."""
        return _then(self._call(ReadSlots), lambda done: tuple(done.slots or ()))

    def load_adapter(self, path: str) -> asyncio.Future[int]:
        """Load a LoRA adapter between two ticks; the future gets its index, or FileNotFoundError, ValueError
        (not an adapter for this model) or AdapterLimit."""
        return _then(self._call(lambda call_id: LoadAdapter(call_id, path)), _index)

    def unload_adapter(self, index: int) -> asyncio.Future[None]:
        """No new request runs with the adapter; the engine frees it when its last request ends."""
        return _then(self._call(lambda call_id: UnloadAdapter(call_id, index)), lambda _: None)

    def routing_report(self, block_tokens: int, max_blocks: int) -> asyncio.Future[RoutingReport]:
        """What the engine holds (its prefixes' hashes in blocks of block_tokens, at most max_blocks: see
        engine/prefix_digest.py) and how busy it is, between two ticks; ValueError for a shape below 1."""
        return _then(self._call(lambda call_id: ReadRoutingReport(call_id, block_tokens, max_blocks)), _report)

    def _call(self, ask: Callable[[int], Question]) -> asyncio.Future[CallDone]:
        """Ask the engine between two ticks (EngineUnavailable now unless it is ready); the future gets its
        answer, or the exception it raised."""
        future: asyncio.Future[CallDone] = asyncio.get_running_loop().create_future()
        with self._lock:
            self.require_engine()
            call = ask(next(self._ids))
            self._calls[call.call_id] = future
        self.transport.send(call)
        return future

    def _answered(self, done: CallDone) -> None:
        """A call's answer, from any thread."""
        with self._lock:
            future = self._calls.pop(done.call_id, None)
        if future is not None:
            _settle_soon(future, done, _refusal(done))

    def _fail_calls(self, message: str) -> None:
        with self._lock:  # with _call's check under the lock, no call is left waiting after this
            calls, self._calls = list(self._calls.values()), {}
        for future in calls:
            _settle_soon(future, None, EngineUnavailable(message))


def _then(asked: asyncio.Future[CallDone], read: Callable[[CallDone], T]) -> asyncio.Future[T]:
    """The answer's part a caller wants, once it comes (a call is sent, or refused, before this returns)."""
    async def answer() -> T:
        return read(await asked)

    return asyncio.ensure_future(answer())


def _index(done: CallDone) -> int:
    assert done.index is not None
    return done.index


def _report(done: CallDone) -> RoutingReport:
    assert done.report is not None
    return done.report


def _refusal(done: CallDone) -> BaseException | None:
    """A call's refusal as the exception the engine raised (the HTTP layer maps each to its 4xx)."""
    if done.error_kind is None:
        return None
    kinds: dict[str, type[Exception]] = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError,
                                         "AdapterLimit": AdapterLimit}
    return kinds.get(done.error_kind, RuntimeError)(done.error)


def _settle_soon(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """From any thread: the future's outcome, set on its event loop (unless it was cancelled meanwhile)."""
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
        future.get_loop().call_soon_threadsafe(settle)
