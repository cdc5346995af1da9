"""A real `cobali serve` on the embedded model for the hostile corpus, and a probe beside it.

The server runs with an API key and --allow-runtime-lora-updating, on a free loopback port, --threads 1 (as
tests/integration/test_server_openai.py: llama.cpp's spinning pool collapses when it competes for cores). It is
started from this checkout, or from the sources named by COBALI_HOSTILE_SOURCE (a git worktree of an older
commit: the "before" table). With --n-batch 96: a tick of the default budget (512 prompt tokens) takes seconds
on one CPU thread, so any long prompt, hostile or not, would hold a probe that long; a smaller tick budget is how
an operator of such a server bounds the stall one tick costs the others. The probe sends a normal 2-token request
every 0.5 s from another loopback address (127.0.0.2): another client, with its own share of the server's workers.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "hostile-corpus-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROBE_BODY = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
PROBE_EVERY_S = 0.5
PROBE_ADDRESS = "127.0.0.2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """The subprocess; `ensure()` starts a fresh one if the last one died or stopped answering."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.restarts = 0
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close(), as the server lives on)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        source = os.environ.get("COBALI_HOSTILE_SOURCE")
        env = {**os.environ, "PYTHONPATH": source} if source else None
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "cobali.faces.cli", "serve", "--port", str(self.port),
                                      "--threads", "1", "--api-key", API_KEY, "--allow-runtime-lora-updating",
                                      "--n-batch", "96",
                                      *self.flags], cwd=source or ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.alive(), f"the server exited at start:\n{self.log_tail()}"
            if self.healthy(1.0):
                return
            time.sleep(0.2)
        raise AssertionError(f"the server did not become healthy:\n{self.log_tail()}")

    def healthy(self, timeout: float) -> bool:
        try:
            return httpx.get(f"{self.base}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def health_status(self, timeout: float = 5.0) -> str:
        try:
            return str(httpx.get(f"{self.base}/health", timeout=timeout).status_code)
        except httpx.HTTPError as err:
            return type(err).__name__

    def answers(self, within_s: float) -> bool:
        """Whether a normal 2-token request comes back within `within_s`: the engine is free again."""
        try:
            return httpx.post(f"{self.base}/v1/completions", json=PROBE_BODY, headers=AUTH,
                              timeout=within_s).status_code == 200
        except httpx.HTTPError:
            return False

    def ensure(self, recover_s: float = 15.0, answer_within_s: float | None = None) -> bool:
        """Healthy (and answering a normal request within `answer_within_s`) within `recover_s`, or killed and
        started again; True if it had to be restarted."""
        deadline = time.monotonic() + recover_s
        while self.alive() and time.monotonic() < deadline:
            if self.healthy(2.0) and (answer_within_s is None or self.answers(answer_within_s)):
                return False
            time.sleep(0.5)
        self.stop()
        self.restarts += 1
        self.start()
        return True

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, chars: int = 3000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-chars:]

    def close(self) -> None:
        self.stop()
        self._log.close()


@dataclass
class ProbeShot:
    start: float
    end: float | None = None
    status: str = ""  # the HTTP status, or the exception's name

    @property
    def ok(self) -> bool:
        return self.status == "200"


@dataclass
class Probe:
    """A normal 2-token request every 0.5 s (the next one at once when one took longer), on its own thread."""

    server: Server
    shots: list[ProbeShot] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hostile-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(40)

    def _run(self) -> None:
        with httpx.Client(timeout=20, transport=httpx.HTTPTransport(local_address=PROBE_ADDRESS)) as client:
            while not self._stop.is_set():
                shot = ProbeShot(time.monotonic())
                self.shots.append(shot)
                try:
                    shot.status = str(client.post(f"{self.server.base}/v1/completions", json=PROBE_BODY,
                                                  headers=AUTH).status_code)
                except httpx.HTTPError as err:
                    shot.status = type(err).__name__
                shot.end = time.monotonic()
                self._stop.wait(max(0.0, PROBE_EVERY_S - (shot.end - shot.start)))

    def baseline(self, shots: int = 6) -> float:
        """The median latency of the next `shots` probes: its usual time."""
        first = len(self.shots)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(s.end is not None for s in self.shots[first:]) < shots:
            time.sleep(0.05)
        return statistics.median(s.end - s.start for s in self.shots[first:] if s.end is not None)

    def worst(self, t0: float, t1: float, wait_s: float = 15.0) -> tuple[float, str]:
        """The longest latency of a probe in flight during [t0, t1], once those in flight have returned (up to
        `wait_s`; one still out counts its time so far), and the first status other than 200 among them ("" if
        none); (0, ""): none ran."""
        deadline = time.monotonic() + wait_s
        window = [s for s in list(self.shots) if s.start <= t1 and (s.end is None or s.end >= t0)]
        while any(s.end is None for s in window) and time.monotonic() < deadline:
            time.sleep(0.05)
        now = time.monotonic()
        failed = next((s.status or "no answer" for s in window if not s.ok), "")
        return max(((s.end or now) - s.start for s in window), default=0.0), failed
