"""Many models behind one endpoint: which are loaded, which load on demand, and which are evicted to make room.

One event loop, no threads. A model holds its bytes (measured once loaded, else its estimate) from the moment its
load starts until its close returns, so the budget (--models-memory, --models-max) counts loads and closes in
progress: two requests waiting for room never count on the same bytes, and no load, once started, waits for
anything but its loader, so no two can deadlock. Room is made by evicting the least recently used models that are
loaded, unpinned, idle (no lease, no request about to take it) and resident at least --models-min-resident; a
request that finds no room waits for a change (a lease, load or close ends; a model's minimum residency ends), up to
--models-load-timeout in all. One load per model at a time, shared by its requests. A failed load fails that
load's requests, is logged, and is not retried for RETRY_AFTER_FAILURE_S; other models never see it. The types,
the arithmetic, the keep_alive parser, the per-client cap and the errors are in model_rules.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from cobali.frontend.model_rules import (
    HOLDING,
    LoadCap,
    Loaded,
    Loader,
    LoadFailed,
    ModelCounts,
    ModelEntry,
    ModelPolicy,
    ModelStatus,
    Slot,
    State,
    check_declared,
    keep_alive_seconds,
    model_load_failed,
    model_load_timeout,
    model_not_found,
    model_too_large,
    models_queue_full,
    models_stopping,
    overflow,
    victims,
)

__all__ = ["LoadFailed", "Loaded", "Loader", "ModelCounts", "ModelEntry", "ModelPolicy", "ModelStatus", "ModelTable",
           "State", "keep_alive_seconds"]

log = logging.getLogger("cobali.http")

RETRY_AFTER_FAILURE_S = 10.0  # a failed model is loaded again no sooner: a broken model costs a load per 10 s


class ModelTable:
    def __init__(self, models: Mapping[str, ModelEntry], policy: ModelPolicy, loader: Loader) -> None:
        check_declared(models, policy)
        self.policy = policy
        self._loader = loader
        self._slots = {name: Slot(entry) for name, entry in models.items()}
        self._cap = LoadCap(policy.loads_per_client, policy.load_window_s)
        self._changed = asyncio.Event()  # set, then replaced, at every change that a waiter or the sweeper awaits
        self._sequence = itertools.count(1)
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    async def start(self) -> None:
        """Load the pinned models (a failure is that model's, logged), and start the keep-alive sweeper."""
        self._sweeper = asyncio.create_task(self._sweep(), name="model keep-alive")
        await asyncio.gather(*(self._start_load(slot) for slot in self._slots.values() if slot.entry.pinned))

    async def stop(self) -> None:
        """Stop the sweeper, and close every loaded model (concurrently)."""
        self._stopping = True
        self._notify()  # waiters wake to a 503
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait({self._sweeper})
        loads = [slot.load for slot in self._slots.values() if slot.state == "loading" and slot.load is not None]
        for load in loads:
            load.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        for slot in self._slots.values():
            if slot.state in ("loaded", "unloading"):
                slot.state = "unloading"
                self._close_soon(slot)
        await asyncio.gather(*(slot.closing for slot in self._slots.values() if slot.closing is not None))

    @asynccontextmanager
    async def lease(self, name: str, client: str, keep_alive_s: float | None = None) -> AsyncIterator[Loaded]:
        """The model, loaded on demand, held (never evicted) until the block exits; then its keep-alive restarts
        (keep_alive_s, the request's own, replaces the model's until the next request says otherwise: a request
        without one restores the model's). APIError: 404 for a name not declared, 400 for a model larger than the
        budget, 429 when its waiting queue is full or the client caused too many loads, 503 when its load failed
        or did not get room in time."""
        slot = self._slot(name)
        keep_alive = None if keep_alive_s is None else keep_alive_seconds(keep_alive_s)
        if slot.entry.bytes > self.policy.memory_bytes:
            raise model_too_large(name, slot.entry.bytes, self.policy.memory_bytes)
        loaded = await self._acquire(slot, client)
        slot.keep_alive_s = keep_alive
        try:
            yield loaded
        finally:
            self._release(slot)

    async def load(self, name: str, client: str) -> None:
        """POST /models/load: loaded (evicting as a request would); returns once it is."""
        async with self.lease(name, client):
            pass

    async def unload(self, name: str) -> None:
        """POST /models/unload: no new request gets it; the ones it serves finish; then it is closed. A model not
        loaded (one loading included) is left as it is; one already unloading is waited for."""
        slot = self._slot(name)
        if slot.state == "loaded":
            slot.counts.unloads += 1
            self._begin_unload(slot)
        while slot.state == "unloading":
            await self._wait_change(math.inf)

    def loaded(self, name: str) -> Loaded | None:
        slot = self._slots.get(name)
        return slot.loaded if slot is not None and slot.state == "loaded" else None

    def statuses(self) -> list[ModelStatus]:
        """Every declared model, in declaration order."""
        now = time.monotonic()
        return [slot.status(self.policy, now) for slot in self._slots.values()]

    def counts(self, name: str) -> ModelCounts:
        return self._slot(name).counts

    def resident_bytes(self) -> int:
        """What loaded and loading models hold (measured where known, else estimated)."""
        return sum(slot.bytes for slot in self._slots.values() if slot.state in HOLDING)

    def _slot(self, name: str) -> Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise model_not_found(name, list(self._slots))
        return slot

    async def _acquire(self, slot: Slot, client: str) -> Loaded:
        if slot.state != "loaded":
            if slot.waiting >= self.policy.max_waiting:
                raise models_queue_full(slot.entry.name, self.policy.max_waiting)
            slot.waiting += 1  # from here until it holds its lease, no eviction or expiry takes the model
            try:
                deadline = time.monotonic() + self.policy.load_timeout_s
                while slot.state != "loaded":
                    await self._step(slot, client, deadline)
            finally:
                slot.waiting -= 1
        if self._stopping:
            raise models_stopping()
        assert slot.loaded is not None
        slot.in_flight += 1
        slot.used = next(self._sequence)
        return slot.loaded

    async def _step(self, slot: Slot, client: str, deadline: float) -> None:
        """One wait for `slot` to be loaded: on its load in progress, or for room (starting its load where it fits,
        evicting where that makes it fit), or for its close to end."""
        if self._stopping:
            raise models_stopping()
        name, now = slot.entry.name, time.monotonic()
        if slot.state == "failed" and now < slot.failed_at + RETRY_AFTER_FAILURE_S:
            raise model_load_failed(name)
        if now >= deadline:
            raise model_load_timeout(name, self.policy.load_timeout_s)
        if slot.state == "loading":
            load = slot.load
            assert load is not None
            await asyncio.wait({load}, timeout=deadline - now)  # never cancels the load: others share it
            if self._stopping:
                raise models_stopping()
            if load.done() and not load.result():
                raise model_load_failed(name)  # this load's failure, whatever the retry delay says
            return
        wake_in = deadline - now
        if slot.state in ("unloaded", "failed"):
            self._cap.check(client, now)  # only a request that would start a load counts against its client
            if overflow(self._slots.values(), slot, self.policy, after_closes=False) == (0, 0):
                self._cap.record(client, now)
                self._start_load(slot)
                return
            evict, resident_ends_in = victims(self._slots.values(), slot, self.policy, now)
            for victim in evict:
                victim.counts.evictions += 1
                self._begin_unload(victim)
            wake_in = min(wake_in, resident_ends_in)
        await self._wait_change(wake_in)

    def _start_load(self, slot: Slot) -> asyncio.Task[bool]:
        assert slot.state in ("unloaded", "failed")
        slot.state, slot.error = "loading", None
        slot.load = asyncio.create_task(self._run_load(slot), name=f"load {slot.entry.name}")
        return slot.load

    async def _run_load(self, slot: Slot) -> bool:
        name, started = slot.entry.name, time.monotonic()
        try:
            loaded = await self._loader(name)
        except asyncio.CancelledError:  # stop(): the loader cleans up what it started
            slot.state = "unloaded"
            raise
        except Exception as err:  # a failed load is that model's alone, whatever it raised
            log.exception("model %r failed to load", name)
            slot.state, slot.error, slot.failed_at = "failed", str(err) or type(err).__name__, time.monotonic()
            slot.counts.load_failures += 1
            return False
        else:
            now = time.monotonic()
            slot.state, slot.loaded, slot.loaded_at, slot.idle_since = "loaded", loaded, now, now
            slot.used = next(self._sequence)
            slot.counts.loads += 1
            slot.counts.load_seconds += now - started
            if self.resident_bytes() > self.policy.memory_bytes:  # measured above its estimate: loads now wait
                log.warning("model %r holds %d bytes, more than estimated: models hold %d of --models-memory's %d",
                            name, slot.bytes, self.resident_bytes(), self.policy.memory_bytes)
            return True
        finally:
            self._notify()

    def _release(self, slot: Slot) -> None:
        slot.in_flight -= 1
        slot.used = next(self._sequence)
        if slot.in_flight == 0:
            slot.idle_since = time.monotonic()
            if slot.state == "unloading":  # unload() waited for this lease
                self._close_soon(slot)
            else:
                self._expire_if_due(slot, slot.idle_since)  # keep-alive 0: now, not at the sweeper's next turn
        self._notify()

    def _expire_if_due(self, slot: Slot, now: float) -> float:
        """Unload `slot` if idle past its keep-alive; else the seconds until it will be (inf: never)."""
        left = slot.expires_in(self.policy, now)
        if left is not None and left <= 0:
            slot.counts.expirations += 1
            self._begin_unload(slot)
            return math.inf
        return math.inf if left is None else left

    async def _sweep(self) -> None:
        """Unload models idle past their keep-alive; sleep until the soonest expiry or the next change."""
        while not self._stopping:
            now = time.monotonic()
            soonest = min((self._expire_if_due(slot, now) for slot in self._slots.values()), default=math.inf)
            await self._wait_change(soonest)

    def _begin_unload(self, slot: Slot) -> None:
        """No new lease takes it; it closes once its leases end (now, if none)."""
        assert slot.state == "loaded"
        slot.state = "unloading"
        if slot.in_flight == 0:
            self._close_soon(slot)

    def _close_soon(self, slot: Slot) -> None:
        if slot.closing is None:
            slot.closing = asyncio.create_task(self._close(slot), name=f"close {slot.entry.name}")

    async def _close(self, slot: Slot) -> None:
        assert slot.loaded is not None
        try:
            await slot.loaded.close()
        except Exception:  # its memory is its engine's to free; the table must not count it forever
            log.exception("model %r failed to close", slot.entry.name)
        finally:
            slot.state, slot.loaded, slot.closing = "unloaded", None, None  # its bytes counted until here
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        """Until the next change, or `timeout` seconds. asyncio.wait, not wait_for: Python 3.11's wait_for swallows
        a cancel that lands as the event is set (stop() does both), and the task would wait on."""
        change = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({change}, timeout=None if math.isinf(timeout) else timeout)
        finally:
            change.cancel()
