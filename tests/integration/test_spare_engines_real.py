"""`cobali serve --models` keeps a spare engine process, started ahead of need (issue 48's cold loads): a cold load
takes it and a new one follows; a spare that died is passed over, the load starts an engine as before, and is
replaced after it; a SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import signal

import pytest
from openai import OpenAI

from cobali.backends.embedded_model import embedded_model_path
from tests.integration.test_engine_process_real import HANG_S, WITHIN_S, children, running, wait_for
from tests.integration.test_many_models_real import engine_pids, process_name, stream_text
from tests.integration.test_server_openai import running_server

pytestmark = pytest.mark.slow  # a server and two model loads: run by .ci/run, not by `make test`


def spares(server_pid: int) -> set[int]:
    return {pid for pid in children(server_pid) if process_name(pid) == "cobali-spare"}


def one_spare(server_pid: int, besides: set[int]) -> int:
    """The server's spare, once there is one that is none of `besides`."""
    wait_for(lambda: len(spares(server_pid) - besides) == 1, HANG_S, f"a spare besides {besides}")
    (spare,) = spares(server_pid)
    return spare


def test_a_cold_load_takes_the_spare_a_dead_one_is_replaced_and_sigterm_ends_them() -> None:
    path = embedded_model_path()
    with running_server("--models", f"a={path}", f"b={path}", "--max-slots", "2", "--ctx", "2048") as (base, proc):
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=HANG_S)
        first = one_spare(proc.pid, set())
        assert engine_pids(proc.pid) == set()  # loaded on demand: no engine yet
        assert stream_text(client, "a")
        assert engine_pids(proc.pid) == {first}  # a's engine is the spare that waited
        second = one_spare(proc.pid, {first})
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: not running(second), HANG_S, "the spare's death")
        assert stream_text(client, "b")  # its engine started as before: the dead spare passed over
        assert len(engine_pids(proc.pid) - {first, second}) == 1
        one_spare(proc.pid, {first, second})
        spawned = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
        # The resource tracker ends once its pipe closes, a moment after the server: an orphan outlives any wait.
        wait_for(lambda: not [pid for pid in spawned if running(pid)], WITHIN_S,
                 f"the server's children exit: {spawned}")
