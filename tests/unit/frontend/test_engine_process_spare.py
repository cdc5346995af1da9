"""A server of many models' spare engine process (cobali.frontend.engine_process.SparePool), and the frontend's
vocabulary loaded beside the engine's load, on the fake backend: a load takes the spare that waits, and a restart
the next one; a spare is replaced after the load that took it, a dead one too; a stopped pool's spare ends and none
follows; the one-model server has none. The text side's slow part starts with the engine's process, not once it
is ready; when it fails, the load fails (Failed, loading=True), and the reader serves on until the stop."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.setup import EngineSetup
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.frontend.client import EngineClient, EngineState
from cobali.frontend.engine_process import ProcessCore, SparePool, TextLoad, TextSide
from cobali.http import serve
from cobali.http.config import ServerConfig
from cobali.structured.compiler import GrammarCompiler
from tests.unit.frontend.test_engine_process import READY_WITHIN_S, SHORT, drive, finals, slow_engine, text_side, until

PRELOAD = ("tests.unit.frontend.test_engine_process",)  # what the factory needs, as PRELOAD is for llama.cpp's
GATE_WAIT_S = 20.0  # how long the gated engine waits for the text side to start: far beyond a thread's start
ONE_SLOT = functools.partial(slow_engine, 1)


def gated_engine(gate: str) -> Engine:
    """An engine that loads only once the frontend's text side has started loading (it creates `gate`)."""
    deadline = time.monotonic() + GATE_WAIT_S
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the frontend's vocabulary did not start loading while the engine loaded")
        time.sleep(0.01)
    return slow_engine(1)


def spare_pid(pool: SparePool) -> int | None:
    spare = pool._spare
    return spare[0].pid if spare is not None and spare[0].is_alive() else None


def run(scenario: Callable[[EngineClient, ProcessCore], Awaitable[None]], text: TextLoad = lambda: text_side,
        factory: Callable[[], Engine] = ONE_SLOT, load_failures: list[str] | None = None,
        **options) -> None:
    core = ProcessCore(factory, text, **options)
    client = EngineClient(core)
    if load_failures is not None:
        client.on_load_failed = load_failures.append
    drive(client, core, scenario)


@pytest.fixture
def pool() -> Iterator[SparePool]:
    spares = SparePool(PRELOAD, refill_after_s=0.0)
    yield spares
    spares.stop()


def test_a_load_takes_the_spare_which_is_replaced_and_a_restart_takes_the_next(pool: SparePool) -> None:
    first = spare_pid(pool)
    assert first is not None

    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        assert client.state is EngineState.READY and core.pid == first
        assert [o.n_tokens for o in await finals(client.submit([([1, 2], SHORT)]))] == [4]
        await until(lambda: spare_pid(pool) not in (None, first), READY_WITHIN_S)  # replaced after the load
        second = spare_pid(pool)
        os.kill(first, signal.SIGKILL)
        await until(lambda: core.pid == second and client.state is EngineState.READY, READY_WITHIN_S)
        assert [o.n_tokens for o in await finals(client.submit([([1, 2], SHORT)]))] == [4]
        await until(lambda: spare_pid(pool) not in (None, first, second), READY_WITHIN_S)

    run(scenario, spares=pool, first_backoff_s=0.01)


def test_a_dead_spare_is_passed_over_and_replaced(pool: SparePool) -> None:
    spare = pool._spare
    assert spare is not None
    dead = spare[0]
    os.kill(dead.pid, signal.SIGKILL)  # type: ignore[arg-type]
    dead.join(READY_WITHIN_S)

    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        assert client.state is EngineState.READY and core.pid not in (None, dead.pid)
        await until(lambda: spare_pid(pool) is not None, READY_WITHIN_S)
        assert spare_pid(pool) not in (dead.pid, core.pid)

    run(scenario, spares=pool)


def test_a_stopped_pools_spare_ends_and_none_follows() -> None:
    pool = SparePool(PRELOAD, refill_after_s=0.0)
    spare = pool._spare
    assert spare is not None and spare[0].is_alive()
    pool.stop()
    assert not spare[0].is_alive() and spare[0].exitcode is not None
    pool._refill()  # a load's timer that fires after the stop
    assert pool._spare is None


def test_the_one_model_server_has_no_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, object]] = []

    class Recorded:  # the transport build_app makes, unstarted and without the sockets' directory
        def __init__(self, _factory: object, _text_side: object, **options: object) -> None:
            made.append(options)

    monkeypatch.setattr(serve, "ProcessCore", Recorded)
    serve.build_app(EngineSetup(EngineConfig(), LlamaCppConfig()), ServerConfig(served_model_name="m",
                                                                                 engine_process=True))
    assert made == [{"spares": None}]


def test_the_vocabulary_loads_while_the_engine_does(tmp_path: Path) -> None:
    gate = tmp_path / "text-side-started"

    def text() -> TextSide:
        gate.touch()
        return text_side

    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        assert client.state is EngineState.READY, client.error
        assert client.tokenizer.encode("hi")

    run(scenario, text, functools.partial(gated_engine, str(gate)))


@pytest.mark.parametrize("part", ["slow", "fast"])
def test_a_vocabulary_that_fails_to_load_fails_the_load(part: str) -> None:
    def bind(_model: ModelInfo) -> tuple[Tokenizer, GrammarCompiler]:
        raise ValueError("no vocabulary here")

    def text() -> TextSide:
        if part == "slow":
            raise ValueError("no vocabulary here")
        return bind

    failures: list[str] = []

    async def scenario(client: EngineClient, core: ProcessCore) -> None:
        assert client.state is EngineState.FAILED and "no vocabulary here" in (client.error or "")
        assert failures == [client.error]  # told as the load's failure (loading=True)
        assert core._reader.is_alive()  # it reads on: the stop ends it, and the engine's process

    run(scenario, text, load_failures=failures)
