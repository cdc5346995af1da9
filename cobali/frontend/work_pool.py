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
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import Request
from starlette.types import Scope

from cobali.frontend.cancels import Canceller
from cobali.frontend.errors import APIError
from cobali.frontend.request_limits import PreprocessLimits

T = TypeVar("T")


@dataclass
class _Client:
    share: asyncio.Semaphore  # workers this client may hold at once
    jobs: int = 0  # its jobs waiting or running (a timed-out one until its thread ends)


class _Job(Generic[T]):
    """One piece of work, from the handler that awaits it to the worker thread that runs it, or skips it.

    The handler awaits `settled`: the work's result or exception, or a timeout's APIError. `ended` runs on the
    loop once, when the job is over: its worker finished it, or it was abandoned before it started; only then
    are the client's share and job count given back."""

    def __init__(self, work: Callable[[], T], settled: asyncio.Future[T], ended: Callable[[], None]) -> None:
        self.work = work
        self.settled = settled
        self.ended = ended
        self.started: float | None = None  # time.monotonic() when a worker picked it up
        self.abandoned = False  # never to run: its start-by time passed, its handler went, or the pool closed
        self.deadline: asyncio.TimerHandle | None = None

    def finish(self, result: Any, error: BaseException | None) -> None:
        """On the loop: a started job's outcome to its handler, unless it stopped waiting; then the share back."""
        if not self.settled.done():
            if error is None:
                self.settled.set_result(result)
            else:
                self.settled.set_exception(error)
        if self.deadline is not None:
            self.deadline.cancel()
        self.ended()


def client_address(scope: Scope) -> str:
    """Whose request this is: the peer's address (behind a proxy, uvicorn's --forwarded-allow-ips makes it the
    client's; under Ray Serve, the gateway hands its proxy's on to the replica, cobali.ray.asgi). Not the API key:
    the clients of one key would then share one share."""
    client = scope.get("client")
    return client[0] if client else "-"


def client_of(http: Request) -> str:
    return client_address(http.scope)


class WorkPool:
    """`limits.workers` daemon threads fed by one queue. A job costs the loop one future, one timer and one
    thread-safe callback: at hundreds of short requests a second, each taking a hop or two here, asyncio.wait
    and concurrent.futures' chaining were a tenth of the server's time (docs/results.md, issue 46)."""

    def __init__(self, limits: PreprocessLimits) -> None:
        self.limits = limits
        self.share = max(1, limits.workers // 2)
        self._clients: dict[str, _Client] = {}
        self._queue: queue.SimpleQueue[tuple[_Job[Any], asyncio.AbstractEventLoop] | None] = queue.SimpleQueue()
        self._claims = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"cobali-preprocess_{i}", daemon=True)
                         for i in range(limits.workers)]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Jobs not started never run; running ones finish on their own (their handlers are gone)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)

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
        start_by = time.monotonic() + self.limits.timeout_s
        try:
            if not await _acquire(entry.share, self.limits.timeout_s):  # its own earlier requests held its share
                raise APIError(429, "this client's earlier requests kept the server's workers busy past "
                               f"--preprocess-timeout ({self.limits.timeout_s:g} s); retry when they are done",
                               "rate_limit_error", code="too_many_requests")
            if self._closed:
                entry.share.release()
                raise APIError(503, "the server is shutting down", "server_error", code="service_unavailable")
        except BaseException:
            self._done(entry, client)
            raise
        return await self._outcome(self._submit(work, entry, client), start_by)

    def _submit(self, work: Callable[[], T], entry: _Client, client: str) -> _Job[T]:
        loop = asyncio.get_running_loop()

        def ended() -> None:  # the share and the job count back when the thread is done, not the handler
            entry.share.release()
            self._done(entry, client)

        job = _Job(work, loop.create_future(), ended)
        self._queue.put((job, loop))
        return job

    def _done(self, entry: _Client, client: str) -> None:
        entry.jobs -= 1
        if entry.jobs == 0 and self._clients.get(client) is entry:
            del self._clients[client]

    async def _outcome(self, job: _Job[T], start_by: float) -> T:
        job.deadline = asyncio.get_running_loop().call_later(max(0.0, start_by - time.monotonic()),
                                                             self._past_deadline, job)
        try:
            return await job.settled
        except asyncio.CancelledError:
            self._abandon(job)  # the client went away: a job not started never runs
            raise

    def _past_deadline(self, job: _Job[Any]) -> None:
        """A job must start within the timeout (else 503: the server is busy), then finish within it from its own
        start (else 400: this request's own work is too large)."""
        job.deadline = None
        if self._abandon(job):
            job.settled.set_exception(APIError(
                503, "the server is too busy preparing requests: this one did not get a worker within "
                f"--preprocess-timeout ({self.limits.timeout_s:g} s)", "server_error", code="service_unavailable"))
            return
        if job.started is None or job.settled.done():  # abandoned already, or finished
            return
        left = job.started + self.limits.timeout_s - time.monotonic()
        if left > 0:
            job.deadline = asyncio.get_running_loop().call_later(left, self._past_deadline, job)
            return
        job.settled.set_exception(APIError(
            400, "preparing this request (its prompt's tokens, chat template and grammar) took longer than this "
            f"server's --preprocess-timeout ({self.limits.timeout_s:g} s)", code="preprocess_timeout"))

    def _abandon(self, job: _Job[Any]) -> bool:
        """On the loop: whether the job had not started, and now never will; its share is given back at once.
        A worker starts a job (_start) and this abandons it under one lock: the first to claim it decides."""
        with self._claims:
            if job.started is not None or job.abandoned:
                return False
            job.abandoned = True
        if job.deadline is not None:
            job.deadline.cancel()
        job.ended()
        return True

    def _start(self, job: _Job[Any]) -> bool:
        with self._claims:
            if job.abandoned:
                return False
            job.started = time.monotonic()
            return True

    def _refuse(self, job: _Job[Any]) -> None:
        """On the loop: a job the closed pool will not run."""
        if self._abandon(job) and not job.settled.done():
            job.settled.set_exception(APIError(503, "the server is shutting down", "server_error",
                                               code="service_unavailable"))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            job, loop = item
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                if self._closed:
                    loop.call_soon_threadsafe(self._refuse, job)
                elif self._start(job):
                    try:
                        outcome: tuple[Any, BaseException | None] = (job.work(), None)
                    except BaseException as err:  # the handler's to raise
                        outcome = (None, err)
                    loop.call_soon_threadsafe(job.finish, *outcome)
            del item, job  # not held while this thread waits for the next job


async def _acquire(semaphore: asyncio.Semaphore, timeout_s: float) -> bool:
    """Take a permit within timeout_s; False if none came. No task and no asyncio.wait: one timer that cancels
    this task if the wait runs over (the semaphore hands a permit granted meanwhile on), as asyncio.timeout does
    from 3.11. A free permit is taken at once."""
    if not semaphore.locked():
        await semaphore.acquire()  # returns without waiting: a permit is free and nobody queues for one
        return True
    expire = Canceller()
    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        await semaphore.acquire()
        return True
    except asyncio.CancelledError:
        if expire.was_ours():
            return False
        raise
    finally:
        timer.cancel()
