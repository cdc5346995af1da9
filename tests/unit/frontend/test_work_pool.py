"""The worker pool's bookkeeping, on the pool alone: a job abandoned before it starts never runs and gives its
client's share back at once; one abandoned while it runs keeps the share until its thread ends; a closed pool runs
nothing more; a free share is taken without a task of its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cobali.frontend.errors import APIError
from cobali.frontend.request_limits import PreprocessLimits
from cobali.frontend.work_pool import WorkPool


def _blocking(release: threading.Event, started: threading.Event | None = None) -> object:
    def work() -> str:
        if started is not None:
            started.set()
        release.wait(10)
        return "done"

    return work


def test_a_job_that_never_got_a_worker_is_a_503_never_runs_and_frees_its_share() -> None:
    pool = WorkPool(PreprocessLimits(workers=1, timeout_s=0.2))
    release, ran = threading.Event(), []

    async def main() -> None:
        holder = asyncio.create_task(pool.run("a", _blocking(release)))  # holds the only worker
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await pool.run("b", lambda: ran.append("b"))
        assert refused.value.status == 503 and "--preprocess-timeout" in refused.value.message
        assert "b" not in pool._clients, "the share of a job that never started was kept"
        release.set()
        with pytest.raises(APIError) as late:  # it ran past the timeout from its own start
            await holder
        assert late.value.status == 400
        assert await pool.run("b", lambda: "quick") == "quick"
        assert ran == [], "a job abandoned before it started ran anyway"

    asyncio.run(main())
    pool.close()


def test_a_job_whose_handler_went_keeps_its_share_until_its_thread_ends() -> None:
    pool = WorkPool(PreprocessLimits(workers=2, timeout_s=5))
    release, started = threading.Event(), threading.Event()

    async def main() -> None:
        running = asyncio.create_task(pool.run("a", _blocking(release, started)))
        await asyncio.to_thread(started.wait, 5)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert pool._clients["a"].jobs == 1, "a running job's share was given back before its thread ended"
        release.set()
        for _ in range(500):
            if "a" not in pool._clients:
                break
            await asyncio.sleep(0.01)
        assert "a" not in pool._clients

    asyncio.run(main())
    pool.close()


def test_a_closed_pool_runs_nothing_more() -> None:
    pool = WorkPool(PreprocessLimits(workers=1, timeout_s=5))
    pool.close()

    async def main() -> None:
        with pytest.raises(APIError) as refused:
            await pool.run("a", lambda: "never")
        assert refused.value.status == 503

    asyncio.run(main())


def test_an_uncontended_job_makes_no_task() -> None:
    """The pool's cost a hop is a future and a callback: no task to wait for a share or for the job."""
    pool = WorkPool(PreprocessLimits(workers=2, timeout_s=5))

    async def main() -> None:
        made: list[object] = []
        loop = asyncio.get_running_loop()
        default = loop.get_task_factory()

        def counting(loop: asyncio.AbstractEventLoop, coro: object, **kwargs: object) -> asyncio.Task:
            made.append(coro)
            return asyncio.Task(coro, loop=loop, **kwargs)  # type: ignore[arg-type]

        assert default is None
        loop.set_task_factory(counting)  # type: ignore[arg-type]
        assert await pool.run("a", lambda: 7) == 7
        assert made == []

    asyncio.run(main())
    pool.close()


def test_a_share_that_never_frees_is_a_429_and_its_permit_is_not_lost() -> None:
    """One client, one worker's share: its second job waits for the share, and past the timeout is refused; the
    share then still serves the client's next job once the first ends."""
    pool = WorkPool(PreprocessLimits(workers=2, timeout_s=0.2))
    release = threading.Event()

    async def main() -> None:
        holder = asyncio.create_task(pool.run("a", _blocking(release)))
        await asyncio.sleep(0.02)
        with pytest.raises(APIError) as refused:
            await pool.run("a", lambda: "never")
        assert refused.value.status == 429
        release.set()
        with pytest.raises(APIError):  # it ran past the timeout
            await holder
        for _ in range(500):
            if "a" not in pool._clients:
                break
            await asyncio.sleep(0.01)
        assert await pool.run("a", lambda: "next") == "next"
        waiting = asyncio.create_task(pool.run("a", _blocking(threading.Event())))
        await asyncio.sleep(0.02)
        queued = asyncio.create_task(pool.run("a", lambda: "queued"))
        await asyncio.sleep(0.02)
        queued.cancel()  # a client gone while it waited for the share: no permit kept by it
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert pool._clients["a"].share._value == 0 and pool._clients["a"].jobs == 1
        waiting.cancel()

    asyncio.run(main())
    pool.close()
