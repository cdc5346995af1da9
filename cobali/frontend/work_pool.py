"""A few worker threads for what a request costs before the engine sees it: tokenizing, rendering the chat
template, building and compiling its grammar. On the event loop, one large prompt or schema would stall every
stream the server is sending; here it waits for a worker, and a handler awaits it.

Fair and bounded: one client (by peer address) runs at most half the workers at once (at least one), so with two
or more workers it never holds them all; its other jobs wait on its own share, not in the pool's queue ahead of
other clients'; and it has at most `client_queue` requests being prepared or waiting to be (beyond it a 429).
A job must start within the timeout (else 503: the server is busy, not the request at fault) and then finish
within it (else 400: this request's own work is too large). Python threads cannot be killed: a job that ran over
keeps its worker, and its client's share, until it ends, so a client cannot turn timeouts into more workers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from starlette.types import Scope

from cobali.frontend.errors import APIError
from cobali.frontend.request_limits import PreprocessLimits

T = TypeVar("T")


@dataclass
class _Client:
    share: asyncio.Semaphore  # workers this client may hold at once
    jobs: int = 0  # its jobs waiting or running (a timed-out one until its thread ends)


@dataclass
class _Job:
    work: Callable[[], object]
    started: float | None = field(default=None)  # time.monotonic() when a worker picked it up

    def __call__(self) -> object:
        self.started = time.monotonic()
        return self.work()


def client_address(scope: Scope) -> str:
    """Whose request this is: the peer's address (behind a proxy, uvicorn's --forwarded-allow-ips makes it the
    client's; under Ray Serve, the gateway hands its proxy's on to the replica, cobali.ray.asgi). Not the API key:
    the clients of one key would then share one share."""
    client = scope.get("client")
    return client[0] if client else "-"


def client_of(http: Request) -> str:
    return client_address(http.scope)


class WorkPool:
    def __init__(self, limits: PreprocessLimits) -> None:
        self.limits = limits
        self.share = max(1, limits.workers // 2)
        self._executor = concurrent.futures.ThreadPoolExecutor(limits.workers, "cobali-preprocess")
        self._clients: dict[str, _Client] = {}

    def close(self) -> None:
        """Jobs not started never run; running ones finish on their own (their handlers are gone)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, client: str, work: Callable[[], T]) -> T:
        """work() on a worker, its result or exception here; APIError 429, 503 or 400 as above."""
        entry = self._clients.get(client)
        if entry is None:
            entry = self._clients[client] = _Client(asyncio.Semaphore(self.share))
        if self.limits.client_queue is not None and entry.jobs >= self.limits.client_queue:
            raise APIError(429, f"this client has {entry.jobs} requests being prepared, the most this server takes "
                           f"(--preprocess-client-queue {self.limits.client_queue}); retry when some are done",
                           "rate_limit_error", code="too_many_requests")
        entry.jobs += 1
        submitted = False
        try:
            start_by = time.monotonic() + self.limits.timeout_s
            if not await _acquire(entry.share, self.limits.timeout_s):  # its own earlier requests held its share
                raise APIError(429, "this client's earlier requests kept the server's workers busy past "
                               f"--preprocess-timeout ({self.limits.timeout_s:g} s); retry when they are done",
                               "rate_limit_error", code="too_many_requests")
            job = _Job(work)
            future, waiting = self._submit(job, entry, client)
            submitted = True
            return await self._outcome(job, future, waiting, start_by)
        finally:
            if not submitted:
                self._done(entry, client, holds_share=False)

    def _submit(self, job: _Job, entry: _Client, client: str) -> tuple[concurrent.futures.Future, asyncio.Future]:
        try:
            future = self._executor.submit(job)
        except RuntimeError:  # shut down
            entry.share.release()
            raise APIError(503, "the server is shutting down", "server_error", code="service_unavailable") from None
        # The share and the job count are given back when the thread is done, not when the handler stops waiting.
        waiting = asyncio.wrap_future(future)
        waiting.add_done_callback(lambda done: self._finished(done, entry, client))
        return future, waiting

    def _finished(self, done: asyncio.Future, entry: _Client, client: str) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: a handler that timed out never reads it
        self._done(entry, client, holds_share=True)

    def _done(self, entry: _Client, client: str, holds_share: bool) -> None:
        if holds_share:
            entry.share.release()
        entry.jobs -= 1
        if entry.jobs == 0 and self._clients.get(client) is entry:
            del self._clients[client]

    async def _outcome(self, job: _Job, future: concurrent.futures.Future, waiting: asyncio.Future,
                       start_by: float) -> T:
        try:
            await asyncio.wait({waiting}, timeout=max(0.0, start_by - time.monotonic()))
            if not waiting.done() and job.started is None and future.cancel():
                raise APIError(503, "the server is too busy preparing requests: this one did not get a worker within "
                               f"--preprocess-timeout ({self.limits.timeout_s:g} s)", "server_error",
                               code="service_unavailable")
            if not waiting.done():  # running: it gets the whole timeout from its own start
                started = job.started if job.started is not None else time.monotonic()
                await asyncio.wait({waiting}, timeout=max(0.0, started + self.limits.timeout_s - time.monotonic()))
            if not waiting.done():
                raise APIError(400, "preparing this request (its prompt's tokens, chat template and grammar) took "
                               f"longer than this server's --preprocess-timeout ({self.limits.timeout_s:g} s)",
                               code="preprocess_timeout")
            return waiting.result()
        except asyncio.CancelledError:
            future.cancel()  # the client went away: a job not started never runs
            raise


async def _acquire(semaphore: asyncio.Semaphore, timeout_s: float) -> bool:
    """Take a permit within timeout_s; False if none came. (asyncio.timeout is 3.11's, and 3.10's wait_for could
    lose a permit that arrived just as it timed out.)"""
    acquiring = asyncio.ensure_future(semaphore.acquire())
    try:
        done, _ = await asyncio.wait({acquiring}, timeout=timeout_s)
    except asyncio.CancelledError:
        _give_up(acquiring, semaphore)
        raise
    if not done:
        _give_up(acquiring, semaphore)
    return bool(done)


def _give_up(acquiring: asyncio.Future, semaphore: asyncio.Semaphore) -> None:
    if not acquiring.done():
        acquiring.cancel()  # a permit handed to it meanwhile is passed on by the acquire itself
    elif not acquiring.cancelled():
        semaphore.release()  # taken just now: given back
