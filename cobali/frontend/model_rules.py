"""The model table's interface types, and its rules that need no waiting (cobali/frontend/model_table.py owns the
waiting and the tasks; it exports the types): each model's record, what fits the budget, which models to evict,
when an idle one expires, the keep_alive parser, the per-client load cap, and the errors the table answers with."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from cobali.frontend.errors import APIError, unknown_model

HOLDING = ("loading", "loaded", "unloading")  # states whose bytes count against the budget


@dataclass(frozen=True)
class ModelEntry:
    """A model the operator declared, as the table sees it."""

    name: str
    bytes: int  # its memory, estimated before it loads (weights + KV + output buffers)
    pinned: bool = False  # loaded at start, never evicted or expired
    keep_alive_s: float | None = None  # its own idle timeout; None: the policy's


@dataclass(frozen=True)
class ModelPolicy:
    memory_bytes: int  # --models-memory: what all loaded (and loading) models may hold together
    max_loaded: int = 4  # --models-max: loaded (and loading) models at once; 0: no limit by count
    keep_alive_s: float = 300.0  # --models-keep-alive: idle time before a model is unloaded; inf: never
    min_resident_s: float = 10.0  # --models-min-resident: a loaded model is kept at least this long (no thrash)
    loads_per_client: int = 6  # --models-loads-per-client: loads one client address may cause per window
    load_window_s: float = 60.0
    max_waiting: int = 256  # --models-queue: requests that may wait for one model's load; beyond: 429
    load_timeout_s: float = 300.0  # --models-load-timeout: a request waits this long for its model; beyond: 503


class Loaded(Protocol):
    """A loaded model, as its loader made it."""

    @property
    def bytes(self) -> int | None:
        """What it holds, measured once loaded (None: the estimate stands)."""

    async def close(self) -> None:
        """Unload: its engine stops and its memory is freed."""


Loader = Callable[[str], Awaitable[Loaded]]  # loads the model of that name; raises LoadFailed(message)
State = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


class LoadFailed(Exception):
    """A model's load failed: the message is for the log; clients are told the model failed to load."""


@dataclass
class ModelCounts:
    """Totals per model, for /metrics."""

    loads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    evictions: int = 0  # unloaded to make room for another
    expirations: int = 0  # unloaded after its keep-alive
    unloads: int = 0  # unloaded by POST /models/unload


@dataclass(frozen=True)
class ModelStatus:
    name: str
    state: State
    bytes: int  # measured once loaded, else the estimate
    pinned: bool
    in_flight: int
    waiting: int  # requests waiting for it to load
    loaded_for_s: float | None  # since its load finished; None unless loaded
    idle_for_s: float | None  # since its last request ended; None while it serves one or is not loaded
    expires_in_s: float | None  # until its keep-alive unloads it; None: never, or not loaded
    error: str | None  # the last load failure's message (state "failed")


@dataclass(eq=False)
class Slot:
    """One declared model's state in the table."""

    entry: ModelEntry
    counts: ModelCounts = field(default_factory=ModelCounts)
    state: State = "unloaded"
    loaded: Loaded | None = None
    load: asyncio.Task[bool] | None = None  # the load in progress (state "loading"): True once loaded
    closing: asyncio.Task[None] | None = None  # its close in progress
    in_flight: int = 0
    waiting: int = 0
    used: int = 0  # least recently used first: the table's sequence number at its last load, lease or release
    loaded_at: float = 0.0
    idle_since: float = 0.0
    keep_alive_s: float | None = None  # the most recent lease's own
    error: str | None = None
    failed_at: float = -math.inf

    @property
    def bytes(self) -> int:
        measured = self.loaded.bytes if self.loaded is not None else None
        return self.entry.bytes if measured is None else measured

    def idle(self) -> bool:
        """Loaded, and neither held nor about to be (a request waiting for it): eviction and expiry may take it."""
        return self.state == "loaded" and not self.entry.pinned and self.in_flight == 0 and self.waiting == 0

    def evictable(self, busy_too: bool) -> bool:
        """May be unloaded for another model: loaded, unpinned, no request waiting for it; idle, unless busy_too
        (then it is drained: its requests in flight finish first)."""
        return (self.state == "loaded" and not self.entry.pinned and self.waiting == 0
                and (busy_too or self.in_flight == 0))

    def keep_alive(self, policy: ModelPolicy) -> float:
        for seconds in (self.keep_alive_s, self.entry.keep_alive_s):
            if seconds is not None:
                return seconds
        return policy.keep_alive_s

    def expires_in(self, policy: ModelPolicy, now: float) -> float | None:
        """Seconds until its keep-alive unloads it (<= 0: due); None while it may not expire."""
        keep_alive = self.keep_alive(policy)
        if not self.idle() or math.isinf(keep_alive):
            return None
        return self.idle_since + keep_alive - now

    def status(self, policy: ModelPolicy, now: float) -> ModelStatus:
        loaded = self.state == "loaded"
        expires_in = self.expires_in(policy, now)
        return ModelStatus(
            name=self.entry.name, state=self.state, bytes=self.bytes, pinned=self.entry.pinned,
            in_flight=self.in_flight, waiting=self.waiting,
            loaded_for_s=now - self.loaded_at if loaded else None,
            idle_for_s=now - self.idle_since if loaded and self.in_flight == 0 else None,
            expires_in_s=None if expires_in is None else max(expires_in, 0.0),
            error=self.error if self.state == "failed" else None)


def overflow(slots: Iterable[Slot], slot: Slot, policy: ModelPolicy, *, after_closes: bool) -> tuple[int, int]:
    """(bytes, models) over the budget were `slot` loaded too, 0 where within it; `after_closes`: once the models
    being unloaded are closed."""
    counted = ("loading", "loaded") if after_closes else HOLDING
    held = [other for other in slots if other.state in counted]
    over_bytes = sum(other.bytes for other in held) + slot.entry.bytes - policy.memory_bytes
    over_count = len(held) + 1 - policy.max_loaded if policy.max_loaded else 0
    return max(over_bytes, 0), max(over_count, 0)


def victims(slots: Iterable[Slot], slot: Slot, policy: ModelPolicy, now: float) -> tuple[list[Slot], float]:
    """The least recently used models whose eviction makes `slot` fit once the closes in progress end ([] when
    nothing more need go, or when even all of them would not do), and the seconds until another model's minimum
    residency ends (inf: none). Idle models first; then, where they do not make room, models serving requests:
    those are drained (their requests finish, new ones wait), so that a steady stream of requests to one model
    cannot keep another from ever loading (Ollama queues behind the busy runner the same way)."""
    slots = sorted(slots, key=lambda candidate: candidate.used)
    over_bytes, over_count = overflow(slots, slot, policy, after_closes=True)
    chosen: list[Slot] = []
    soonest = math.inf
    for busy_too in (False, True):
        for other in slots:
            if (over_bytes <= 0 and over_count <= 0) or other in chosen or not other.evictable(busy_too):
                continue
            resident_until = other.loaded_at + policy.min_resident_s
            if resident_until > now:
                soonest = min(soonest, resident_until - now)
                continue
            chosen.append(other)
            over_bytes, over_count = over_bytes - other.bytes, over_count - 1
    return (chosen if over_bytes <= 0 and over_count <= 0 else []), soonest


def check_declared(models: Mapping[str, ModelEntry], policy: ModelPolicy) -> None:
    """The operator's errors: a model declared under another name, or pinned models that cannot all be loaded at
    once. ValueError naming them."""
    for name, entry in models.items():
        if entry.name != name:
            raise ValueError(f"the model declared as {name!r} is named {entry.name!r}")
    pinned = [entry for entry in models.values() if entry.pinned]
    held = sum(entry.bytes for entry in pinned)
    if held > policy.memory_bytes or (policy.max_loaded and len(pinned) > policy.max_loaded):
        names = ", ".join(entry.name for entry in pinned)
        raise ValueError(f"the pinned models ({names}) need {held} bytes and {len(pinned)} models loaded at once: "
                         f"more than --models-memory ({policy.memory_bytes} bytes) or --models-max "
                         f"({policy.max_loaded}) allows")


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DIGITS = frozenset("0123456789.")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")
_SHOWN_MODELS = 10  # a 404 names this many declared models, then "..."


def keep_alive_seconds(value: str | float | int) -> float:
    """Ollama's keep_alive: seconds as a number, or a duration ("30s", "5m", "1h", "1h30m", "250ms"); negative:
    forever (inf); 0: unload as soon as it is idle. ValueError naming the value otherwise."""
    if isinstance(value, bool):  # JSON's true is an int to Python, not a duration
        raise _not_a_duration(value)
    seconds = float(value) if isinstance(value, (int, float)) else _parse_duration(value)
    if math.isnan(seconds):
        raise _not_a_duration(value)
    return math.inf if seconds < 0 else seconds


def _parse_duration(value: str) -> float:
    """One left-to-right pass (a client sends this text): [sign] then number-unit pairs, or a plain number."""
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text[1:] if text[:1] in ("-", "+") else text
    total, at, end = 0.0, 0, len(text)
    if end == 0:
        raise _not_a_duration(value)
    while at < end:
        digits_end = at
        while digits_end < end and text[digits_end] in _DIGITS:
            digits_end += 1
        unit_end = digits_end
        while unit_end < end and text[unit_end] in _LETTERS:
            unit_end += 1
        number, unit = text[at:digits_end], text[digits_end:unit_end]
        plain = not unit and at == 0 and unit_end == end  # "300": seconds
        if number.count(".") > 1 or not number.strip(".") or not (plain or unit in _UNITS):
            raise _not_a_duration(value)
        total += float(number) * (1.0 if plain else _UNITS[unit])
        at = unit_end
    return sign * total


def _not_a_duration(value: object) -> ValueError:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."  # a client's text, maybe huge
    return ValueError(f"keep_alive {shown} is not a duration: give seconds, or like '250ms', '30s', '5m', "
                      "'1h30m'; negative: forever")


class LoadCap:
    """The loads each client address started in the last window; only clients with a load inside it are kept."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit  # 0: no cap
        self.window_s = window_s
        self._starts: dict[str, deque[float]] = {}

    def check(self, client: str, now: float) -> None:
        """APIError 429 when this client may start no load now."""
        starts = self._starts.get(client)
        if starts is None or self.limit <= 0:
            return
        while starts and starts[0] <= now - self.window_s:
            starts.popleft()
        if len(starts) >= self.limit:
            raise APIError(429, f"this client caused {len(starts)} model loads in the last {self.window_s:g} s, "
                           f"the most --models-loads-per-client ({self.limit}) allows; retry later, or use a "
                           "model that is loaded", "rate_limit_error", param="model", code="too_many_model_loads")

    def record(self, client: str, now: float) -> None:
        # Every client is pruned here: loads are rare (each takes seconds), so the map stays as small as the
        # loads inside one window.
        for known in list(self._starts):
            starts = self._starts[known]
            while starts and starts[0] <= now - self.window_s:
                starts.popleft()
            if not starts:
                del self._starts[known]
        self._starts.setdefault(client, deque()).append(now)


def model_not_found(name: str, declared: list[str]) -> APIError:
    shown = ", ".join(declared[:_SHOWN_MODELS]) + (", ..." if len(declared) > _SHOWN_MODELS else "")
    return unknown_model(name, shown)


def model_too_large(name: str, size: int, budget: int) -> APIError:
    return APIError(400, f"the model '{name}' needs {size} bytes, more than --models-memory ({budget} bytes) "
                    "holds for all models together; it is never loaded", param="model", code="model_too_large")


def models_queue_full(name: str, limit: int) -> APIError:
    return APIError(429, f"{limit} requests already wait for the model '{name}' to load, the most --models-queue "
                    f"({limit}) allows; retry later", "rate_limit_error", param="model", code="models_queue_full")


def model_load_failed(name: str) -> APIError:
    return APIError(503, f"the model '{name}' failed to load; see the server log", "server_error",
                    code="model_load_failed")


def model_load_timeout(name: str, limit_s: float) -> APIError:
    return APIError(503, f"the model '{name}' was not loaded within --models-load-timeout ({limit_s:g} s); the "
                    "memory may be held by models in use; retry later", "server_error", code="model_load_timeout")


def models_stopping() -> APIError:
    return APIError(503, "the server is shutting down", "server_error", code="service_unavailable")
