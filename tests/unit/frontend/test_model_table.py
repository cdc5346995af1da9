"""The model table on a fake loader: the memory budget holds under concurrent leases, eviction takes the least
recently used idle model and never a pinned, busy or just-loaded one, one load serves every request waiting for
it, a failed load is its model's alone, keep-alives expire, unload waits for the requests in flight, and two
models that cannot both fit, asked for alternately, neither deadlock nor thrash."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from cobali.frontend import model_table
from cobali.frontend.errors import APIError
from cobali.frontend.model_rules import LoadCap
from cobali.frontend.model_table import LoadFailed, ModelEntry, ModelPolicy, ModelTable, keep_alive_seconds


class FakeModel:
    def __init__(self, fake: FakeLoader, name: str) -> None:
        self.fake, self.name = fake, name

    @property
    def bytes(self) -> int | None:
        return self.fake.measured.get(self.name)

    async def close(self) -> None:
        await asyncio.sleep(self.fake.close_s)  # a close takes a while: its bytes must count until it returns
        self.fake.closes.append(self.name)
        self.fake.closed_at[self.name] = time.monotonic()
        del self.fake.held[self.name]


class FakeLoader:
    """Records loads and closes; a model with a gate loads when its gate is set; checks, at every load, the
    memory it holds itself (from a load's start to its close's return) against the budget."""

    def __init__(self, sizes: dict[str, int], budget: int, max_loaded: int = 0, close_s: float = 0.0) -> None:
        self.sizes, self.budget, self.max_loaded, self.close_s = sizes, budget, max_loaded, close_s
        self.gates: dict[str, asyncio.Event] = {}
        self.failing: dict[str, Exception] = {}
        self.measured: dict[str, int] = {}
        self.loads: list[str] = []
        self.closes: list[str] = []
        self.held: dict[str, int] = {}
        self.loaded_at: dict[str, float] = {}
        self.closed_at: dict[str, float] = {}
        self.breaches: list[dict[str, int]] = []

    async def __call__(self, name: str) -> FakeModel:
        assert name not in self.held, f"{name} loaded twice at once"
        self.loads.append(name)
        self.held[name] = self.sizes[name]
        if sum(self.held.values()) > self.budget or (self.max_loaded and len(self.held) > self.max_loaded):
            self.breaches.append(dict(self.held))
        try:
            gate = self.gates.get(name)
            if gate is not None:
                await gate.wait()
            await asyncio.sleep(0)
            if name in self.failing:
                raise self.failing[name]
        except BaseException:
            del self.held[name]
            raise
        self.loaded_at[name] = time.monotonic()
        return FakeModel(self, name)


def _policy(**overrides: Any) -> ModelPolicy:
    settings: dict[str, Any] = dict(memory_bytes=10, max_loaded=0, keep_alive_s=math.inf, min_resident_s=0.0,
                                    loads_per_client=10_000, load_timeout_s=30.0)
    return ModelPolicy(**(settings | overrides))


def _table(sizes: dict[str, int], policy: ModelPolicy, pinned: tuple[str, ...] = (),
           keep_alive: dict[str, float] | None = None, close_s: float = 0.0) -> tuple[ModelTable, FakeLoader]:
    fake = FakeLoader(sizes, policy.memory_bytes, policy.max_loaded, close_s)
    entries = {name: ModelEntry(name, size, name in pinned, (keep_alive or {}).get(name)) for name, size in
               sizes.items()}
    return ModelTable(entries, policy, fake), fake


def _run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), 60))  # a hang fails the test, not the suite


async def _until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10  # far from any moment these tests wait for
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.001)


async def _use(table: ModelTable, name: str, client: str = "c", keep_alive_s: float | None = None) -> None:
    async with table.lease(name, client, keep_alive_s):
        await asyncio.sleep(0)


async def _refused(call: Awaitable[object]) -> APIError:
    with pytest.raises(APIError) as refused:
        await call
    return refused.value


def _state(table: ModelTable, name: str) -> str:
    return next(status.state for status in table.statuses() if status.name == name)


def _status(table: ModelTable, name: str) -> model_table.ModelStatus:
    return next(status for status in table.statuses() if status.name == name)


def test_concurrent_leases_of_many_models_never_hold_more_than_the_budget() -> None:
    table, fake = _table({"a": 4, "b": 3, "c": 3, "d": 5, "e": 2}, _policy(max_loaded=3), close_s=0.002)
    rng = random.Random(7)

    async def client(index: int) -> None:
        for _ in range(15):
            async with table.lease(rng.choice("abcde"), f"client{index}"):
                assert table.resident_bytes() <= 10
                await asyncio.sleep(rng.choice((0, 0.001)))

    async def main() -> None:
        await asyncio.gather(*(client(index) for index in range(12)))
        await table.stop()

    _run(main)
    assert fake.breaches == [], f"the loader held more than the budget: {fake.breaches[:3]}"
    assert sum(table.counts(name).evictions for name in "abcde") > 10, "the workload forced no evictions"


def test_eviction_takes_the_least_recently_used_idle_model() -> None:
    table, fake = _table({name: 1 for name in "abcde"}, _policy(memory_bytes=3))

    async def main() -> None:
        for name in "abca":  # a, b, c loaded; a used again: b is now the least recently used
            await _use(table, name)
        await _use(table, "d")
        await _use(table, "e")
        await _use(table, "b")  # a was used before d and e
        await table.stop()

    _run(main)
    assert fake.closes[:3] == ["b", "c", "a"]
    assert table.counts("b").evictions == 1 and table.counts("a").evictions == 1


def test_max_loaded_evicts_by_count() -> None:
    table, fake = _table({name: 1 for name in "abc"}, _policy(memory_bytes=100, max_loaded=2))

    async def main() -> None:
        for name in "abc":
            await _use(table, name)
        assert fake.closes == ["a"] and fake.breaches == []

    _run(main)


def test_a_models_measured_bytes_replace_its_estimate() -> None:
    table, fake = _table({"a": 6, "b": 6}, _policy(load_timeout_s=1.0))
    fake.measured["a"] = 3

    async def main() -> None:
        async with table.lease("a", "c"):
            status = _status(table, "a")
            assert (status.state, status.bytes, status.in_flight, status.idle_for_s) == ("loaded", 3, 1, None)
            await _use(table, "b")  # 3 + 6 fit beside a, busy
        status = _status(table, "a")
        assert status.idle_for_s is not None and status.loaded_for_s is not None and status.expires_in_s is None
        assert table.resident_bytes() == 9 and fake.closes == [] and table.loaded("a") is not None

    _run(main)


def test_pinned_models_are_loaded_at_start_and_never_evicted() -> None:
    table, fake = _table({"p": 5, "a": 5, "b": 5}, _policy(load_timeout_s=0.2), pinned=("p",))

    async def main() -> None:
        await table.start()
        assert _state(table, "p") == "loaded"
        await _use(table, "a")
        await _use(table, "b")  # evicts a, not p
        async with table.lease("b", "c"):
            refused = await _refused(_use(table, "a"))  # only p (pinned) and b (busy) hold memory
        assert refused.status == 503 and refused.code == "model_load_timeout"
        assert "--models-load-timeout" in refused.message
        await table.stop()

    _run(main)
    assert fake.closes[0] == "a" and fake.closes.count("p") == 1, "p was closed before stop()"


def test_pinned_models_that_cannot_all_be_loaded_are_the_operators_error() -> None:
    entries = {name: ModelEntry(name, 6, pinned=True) for name in ("p", "q")}
    with pytest.raises(ValueError, match=r"pinned models \(p, q\) need 12 bytes.*--models-memory \(10 bytes\)"):
        ModelTable(entries, _policy(), FakeLoader({}, 10))
    with pytest.raises(ValueError, match="--models-max"):
        ModelTable(entries, _policy(memory_bytes=100, max_loaded=1), FakeLoader({}, 100))


def test_a_model_in_use_is_drained_never_closed_under_its_lease_and_the_waiter_gets_room_when_it_ends() -> None:
    """a serves a request when b is asked for and only one fits: a takes no new request (they wait), its lease
    runs to its end, then a is closed and b loads; a request for a after b's then waits for a's turn."""
    table, fake = _table({"a": 6, "b": 6}, _policy())

    async def main() -> None:
        async with table.lease("a", "c"):
            waiter = asyncio.create_task(_use(table, "b"))
            await _until(lambda: _state(table, "a") == "unloading", "a is drained for b")
            late_a = asyncio.create_task(_use(table, "a"))
            await asyncio.sleep(0.05)
            assert not waiter.done() and not late_a.done() and fake.closes == [], "a model was closed under its lease"
        await waiter
        assert fake.closes[0] == "a" and fake.loads[:2] == ["a", "b"]
        await late_a  # b idle again: a's turn
        assert fake.breaches == []

    _run(main)


def test_a_steady_stream_of_requests_to_one_model_does_not_starve_another() -> None:
    """Requests to a, each overlapping the next, never leave a idle: b's request still gets its turn."""
    table, fake = _table({"a": 6, "b": 6}, _policy(load_timeout_s=30.0))

    async def stream_of_a(stop: asyncio.Event) -> None:
        async def one() -> None:
            async with table.lease("a", "c"):
                await asyncio.sleep(0.01)

        running: set[asyncio.Task] = set()
        while not stop.is_set():
            task = asyncio.create_task(one())
            running.add(task)
            task.add_done_callback(running.discard)
            await asyncio.sleep(0.005)  # a new one before the last ends
        await asyncio.gather(*running)

    async def main() -> None:
        stop = asyncio.Event()
        await _use(table, "a")
        feeder = asyncio.create_task(stream_of_a(stop))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(_use(table, "b"), 10)
        stop.set()
        await feeder
        assert "b" in fake.loads and fake.breaches == []

    _run(main)


def test_a_just_loaded_model_stays_its_minimum_residency() -> None:
    table, fake = _table({"a": 6, "b": 6}, _policy(min_resident_s=0.3))

    async def main() -> None:
        await _use(table, "a")
        await _use(table, "b")  # waits until a has been resident 0.3 s
        assert fake.closes == ["a"]
        assert fake.closed_at["a"] - fake.loaded_at["a"] >= 0.3

    _run(main)


def test_a_request_that_minimum_residency_keeps_from_room_gets_a_503_at_its_load_timeout() -> None:
    table, fake = _table({"a": 6, "b": 6}, _policy(min_resident_s=60, load_timeout_s=0.1))

    async def main() -> None:
        await _use(table, "a")
        refused = await _refused(_use(table, "b"))
        assert refused.status == 503 and refused.code == "model_load_timeout" and fake.closes == []

    _run(main)


def test_one_load_serves_every_request_waiting_for_it() -> None:
    table, fake = _table({"a": 1}, _policy())
    fake.gates["a"] = asyncio.Event()
    got: list[object] = []

    async def lease() -> None:
        async with table.lease("a", "c") as model:
            got.append(model)

    async def main() -> None:
        waiters = [asyncio.create_task(lease()) for _ in range(5)]
        await _until(lambda: _status(table, "a").waiting == 5, "5 requests wait")
        assert _state(table, "a") == "loading"
        fake.gates["a"].set()
        await asyncio.gather(*waiters)

    _run(main)
    assert fake.loads == ["a"] and len(got) == 5 and len({id(model) for model in got}) == 1
    assert table.counts("a").loads == 1


def test_a_full_waiting_queue_is_a_429_and_a_loaded_model_has_no_queue() -> None:
    table, fake = _table({"a": 1}, _policy(max_waiting=2))
    fake.gates["a"] = asyncio.Event()

    async def main() -> None:
        waiters = [asyncio.create_task(_use(table, "a")) for _ in range(2)]
        await _until(lambda: _status(table, "a").waiting == 2, "2 requests wait")
        refused = await _refused(_use(table, "a"))
        assert refused.status == 429 and refused.code == "models_queue_full" and "--models-queue" in refused.message
        fake.gates["a"].set()
        await asyncio.gather(*waiters)
        await asyncio.gather(*(_use(table, "a") for _ in range(10)))

    _run(main)


def test_a_model_larger_than_the_budget_is_a_400_and_an_unknown_one_a_404() -> None:
    sizes = {"big": 11} | {f"m{index}": 1 for index in range(11)}
    table, fake = _table(sizes, _policy())

    async def main() -> None:
        large = await _refused(_use(table, "big"))
        assert large.status == 400 and large.code == "model_too_large"
        assert "11 bytes" in large.message and "--models-memory (10 bytes)" in large.message
        unknown = await _refused(_use(table, "nope"))
        assert unknown.status == 404 and unknown.code == "model_not_found" and "'nope'" in unknown.message
        assert "big, m0, m1" in unknown.message and "m8, ..." in unknown.message and "m9" not in unknown.message
        assert (await _refused(table.unload("nope"))).status == 404

    _run(main)
    assert fake.loads == [] and "big" in table and "nope" not in table


def test_loads_a_client_starts_are_capped_but_joining_or_using_a_loaded_model_is_not() -> None:
    table, fake = _table({name: 1 for name in "abcd"}, _policy(loads_per_client=2))
    fake.gates["d"] = asyncio.Event()

    async def main() -> None:
        await table.load("a", "x")  # POST /models/load counts like a request
        await _use(table, "b", "x")
        refused = await _refused(_use(table, "c", "x"))
        assert refused.status == 429 and refused.code == "too_many_model_loads"
        assert "--models-loads-per-client (2)" in refused.message
        await _use(table, "a", "x")  # loaded: no load started
        starter = asyncio.create_task(_use(table, "d", "y"))
        await _until(lambda: _state(table, "d") == "loading", "y's load of d starts")
        joiner = asyncio.create_task(_use(table, "d", "x"))  # joins y's load
        await _until(lambda: _status(table, "d").waiting == 2, "x joins")
        fake.gates["d"].set()
        await asyncio.gather(starter, joiner)
        await _use(table, "c", "z")  # another client's cap is its own

    _run(main)
    assert fake.loads == ["a", "b", "d", "c"]


def test_the_load_cap_keeps_only_clients_with_a_load_inside_the_window() -> None:
    cap = LoadCap(limit=1, window_s=10.0)
    for index in range(100):
        cap.record(f"client{index}", now=float(index))
    assert len(cap._starts) == 10, "clients whose loads left the window were kept"
    with pytest.raises(APIError):
        cap.check("client99", now=100.0)
    cap.check("client99", now=109.5)  # its load left the window


@pytest.mark.parametrize("error", [LoadFailed("/secret/weights.gguf: bad magic"), RuntimeError("/secret: boom")])
def test_a_failed_load_fails_its_waiters_alone_and_is_retried_no_sooner_than_the_delay(
        error: Exception, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    table, fake = _table({"a": 4, "b": 4}, _policy())
    fake.gates["a"], fake.failing["a"] = asyncio.Event(), error

    async def main() -> None:
        waiters = [asyncio.create_task(_use(table, "a")) for _ in range(3)]
        await _until(lambda: _status(table, "a").waiting == 3, "3 requests wait for a")
        await _use(table, "b")  # b is served while a loads
        fake.gates["a"].set()
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        for outcome in outcomes:
            assert isinstance(outcome, APIError) and outcome.status == 503 and outcome.code == "model_load_failed"
            assert outcome.message == "the model 'a' failed to load; see the server log"
        status = _status(table, "a")
        assert status.state == "failed" and status.error is not None and "/secret" in status.error
        assert table.counts("a").load_failures == 1 and table.resident_bytes() == 4  # b's alone
        again = await _refused(_use(table, "a"))  # within the retry delay: no new load
        assert again.code == "model_load_failed" and fake.loads.count("a") == 1
        await _use(table, "b")
        monkeypatch.setattr(model_table, "RETRY_AFTER_FAILURE_S", 0.0)
        del fake.failing["a"]
        await _use(table, "a")
        assert fake.loads.count("a") == 2 and _state(table, "a") == "loaded"

    _run(main)
    assert any(record.exc_info and "failed to load" in record.getMessage() for record in caplog.records)


def test_the_waiters_of_a_failed_load_fail_even_with_no_retry_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_table, "RETRY_AFTER_FAILURE_S", 0.0)
    table, fake = _table({"a": 1}, _policy())
    fake.gates["a"], fake.failing["a"] = asyncio.Event(), LoadFailed("no")

    async def main() -> None:
        waiters = [asyncio.create_task(_use(table, "a")) for _ in range(3)]
        await _until(lambda: _status(table, "a").waiting == 3, "3 requests wait")
        fake.gates["a"].set()
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(outcome, APIError) and outcome.status == 503 for outcome in outcomes)

    _run(main)
    assert fake.loads == ["a"], "a waiter of the failed load started another"


def test_keep_alive_zero_unloads_when_the_last_lease_ends_but_never_a_pinned_model() -> None:
    table, fake = _table({"a": 1, "p": 1}, _policy(keep_alive_s=0.0), pinned=("p",))

    async def main() -> None:
        await table.start()
        async with table.lease("a", "c"), table.lease("a", "c"):
            pass
        assert _state(table, "a") == "unloading"  # at once, not at a sweep
        await _until(lambda: _state(table, "a") == "unloaded", "a closes")
        await _use(table, "p")
        await asyncio.sleep(0.05)
        assert _state(table, "p") == "loaded"
        await table.stop()

    _run(main)
    assert fake.closes[0] == "a" and table.counts("a").expirations == 1 and table.counts("p").expirations == 0


def test_a_short_keep_alive_expires_after_it_and_the_sweeper_sleeps_until_then(
        monkeypatch: pytest.MonkeyPatch) -> None:
    table, fake = _table({"a": 1}, _policy(keep_alive_s=0.3))
    sweeps: list[float] = []

    async def main() -> None:
        await table.start()
        expire_if_due = table._expire_if_due

        def counted(slot: Any, now: float) -> float:
            sweeps.append(now)
            return expire_if_due(slot, now)

        monkeypatch.setattr(table, "_expire_if_due", counted)
        async with table.lease("a", "c"):
            released = time.monotonic()  # before the lease ends: the keep-alive runs from a later moment
        expires_in = _status(table, "a").expires_in_s
        assert expires_in is not None and 0 <= expires_in <= 0.3
        await _until(lambda: "a" in fake.closes, "a expires")
        assert fake.closed_at["a"] - released >= 0.3
        await table.stop()

    _run(main)
    assert table.counts("a").expirations == 1
    assert len(sweeps) <= 15, f"the sweeper polled: {len(sweeps)} sweeps for one expiry"


def test_a_requests_keep_alive_replaces_the_models_until_a_request_without_one() -> None:
    table, _ = _table({"a": 1, "c": 1}, _policy(keep_alive_s=0.0), keep_alive={"c": math.inf})

    async def main() -> None:
        await table.start()
        await _use(table, "a", keep_alive_s=-1)  # negative: forever
        assert _state(table, "a") == "loaded" and _status(table, "a").expires_in_s is None
        await _use(table, "a")  # back to the policy's 0
        assert _state(table, "a") == "unloading"
        await _use(table, "c")  # its entry's inf
        assert _state(table, "c") == "loaded"
        await _use(table, "c", keep_alive_s=0)
        assert _state(table, "c") == "unloading"
        await table.stop()

    _run(main)


def test_unload_waits_for_the_requests_in_flight_and_a_new_request_loads_it_again() -> None:
    table, fake = _table({"a": 1, "b": 1}, _policy())

    async def main() -> None:
        async with table.lease("a", "c"):
            unloading = asyncio.create_task(table.unload("a"))
            await _until(lambda: _state(table, "a") == "unloading", "a unloads")
            again = asyncio.create_task(_use(table, "a"))
            await _until(lambda: _status(table, "a").waiting == 1, "a new request waits")
            await asyncio.sleep(0.02)
            assert not unloading.done() and fake.closes == [], "closed under a lease"
        await unloading
        assert fake.closes == ["a"] and table.counts("a").unloads == 1
        await again
        assert fake.loads == ["a", "a"]
        await table.unload("b")  # not loaded: nothing to do
        assert table.counts("b").unloads == 0

    _run(main)


def test_stop_closes_every_model_and_fails_the_waiters() -> None:
    table, fake = _table({"a": 3, "b": 3, "c": 3}, _policy())
    fake.gates["c"] = asyncio.Event()

    async def main() -> None:
        await table.start()
        await _use(table, "a")
        await _use(table, "b")
        waiter = asyncio.create_task(_use(table, "c"))
        await _until(lambda: _state(table, "c") == "loading", "c loads")
        await table.stop()
        refused = await _refused(waiter)
        assert refused.status == 503
        assert sorted(fake.closes) == ["a", "b"] and fake.held == {}
        assert {status.state for status in table.statuses()} == {"unloaded"}
        assert (await _refused(_use(table, "a"))).status == 503

    _run(main)


def test_stop_returns_when_the_sweeper_is_cancelled_as_a_change_wakes_it() -> None:
    """stop() sets the change event and cancels the sweeper together, while the sweeper waits with a timeout (a
    finite keep-alive): Python 3.11's asyncio.wait_for returned instead of raising, and stop() waited forever."""
    table, fake = _table({"a": 3}, _policy(keep_alive_s=300.0))

    async def main() -> None:
        await table.start()
        await _use(table, "a")
        await asyncio.sleep(0.01)  # the sweeper is waiting out a's keep-alive
        await asyncio.wait_for(table.stop(), 10)
        assert fake.closes == ["a"]

    _run(main)


async def _alternate(table: ModelTable, clients: int, rounds: int) -> None:
    async def client(index: int) -> None:
        for turn in range(rounds):
            async with table.lease("ab"[(index + turn) % 2], f"client{index}"):
                await asyncio.sleep(0.001)

    await asyncio.gather(*(client(index) for index in range(clients)))


def test_two_models_larger_than_half_the_budget_asked_for_alternately_never_deadlock() -> None:
    table, fake = _table({"a": 6, "b": 6}, _policy())

    async def main() -> None:
        await _alternate(table, clients=20, rounds=10)

    _run(main)
    assert fake.breaches == [] and len(fake.loads) >= 2


def test_alternating_requests_load_no_more_often_than_the_minimum_residency_allows() -> None:
    min_resident = 0.1
    table, fake = _table({"a": 6, "b": 6}, _policy(min_resident_s=min_resident))

    async def main() -> None:
        started = time.monotonic()
        await _alternate(table, clients=10, rounds=6)
        elapsed = time.monotonic() - started
        # Each load after the first evicts the other model, resident at least min_resident since its own load.
        assert len(fake.loads) <= elapsed / min_resident + 2, (fake.loads, elapsed)

    _run(main)
    assert fake.breaches == [] and len(fake.loads) >= 2


@pytest.mark.parametrize(("text", "seconds"), [
    (300, 300.0), (1.5, 1.5), (0, 0.0), (-1, math.inf), ("300", 300.0), ("-1", math.inf), ("250ms", 0.25),
    ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("1h30m", 5400.0), ("1.5h", 5400.0), (" 2m ", 120.0),
    ("-5m", math.inf), ("0", 0.0), ("1m30s500ms", 90.5), (".5s", 0.5)])
def test_keep_alive_durations(text: str | float, seconds: float) -> None:
    assert keep_alive_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "-", "s", "5x", "5 m", "1h30", "1..5s", ".s", "5M", "1e3",
                                  "nan", "inf", True, float("nan"), "٣s"])
def test_keep_alive_garbage_is_a_value_error_naming_it(text: str | float) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        keep_alive_seconds(text)


def test_keep_alive_parses_in_linear_time_and_names_a_long_value_briefly() -> None:
    def cost(size: int) -> float:
        text = "1s" * size + "x"
        best = math.inf
        for _ in range(3):
            started = time.thread_time()  # CPU time: a preempted moment on a busy machine is not counted
            with pytest.raises(ValueError) as refused:
                keep_alive_seconds(text)
            best = min(best, time.thread_time() - started)
        assert len(str(refused.value)) < 200
        return best

    small, large = cost(10_000), cost(100_000)
    assert large / small < 40, f"10x the text cost {large / small:.0f}x the time"
