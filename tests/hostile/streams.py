"""The corpus cases that are not one request and its answer: a client that stops reading an SSE stream, clients
that disconnect mid-request, and the LoRA load oracle. Each returns an Outcome for the harness's table."""

from __future__ import annotations

import select
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.hostile.corpus import Case, encode
from tests.hostile.server import API_KEY, AUTH, Server

STALL_WINDOW_S = 15.0  # how long a client that stopped reading is watched
DISCONNECT_WINDOW_S = 8.0  # how long a request may go on after its client left
START_WINDOW_S = 15.0  # how long a streamed or long request may take to hold its slots


@dataclass(frozen=True)
class Outcome:
    status: str  # the HTTP status, an exception's name, or what became of a stream
    seconds: float
    ok: bool | None  # None: not provoked here (neither a pass nor a failure)
    # How long the case's client kept its request running before it left: prompts that the probe, queued
    # behind them (first come, first served), may legitimately wait for.
    held_s: float = 0.0


def raw_request(server: Server, case: Case, rcvbuf: int | None = None) -> socket.socket:
    """The case's POST on a plain socket, so the test decides when (and whether) to read."""
    sock = socket.socket()
    if rcvbuf is not None:  # a small receive window: the server's writes block sooner
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", server.port))
    body = case.body or b""
    head = (f"POST {case.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def ours_running(server: Server) -> bool:
    """Whether a request other than the probe's (a prompt of a few tokens, 2 tokens out) holds a slot."""
    rows = httpx.get(f"{server.base}/slots", headers=AUTH, timeout=10).json()
    return any(r["is_processing"] and (r["n_prompt_tokens"] > 50 or r["n_decoded"] > 2) for r in rows)


def _wait_until(predicate: Callable[[], bool], window_s: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < window_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.25)
    return None


def send_queue_bytes(server: Server, client_port: int) -> int | None:
    """What the kernel holds unsent on the server's side of the connection (/proc/net/tcp's tx_queue)."""
    local, remote = f"0100007F:{server.port:04X}", f"0100007F:{client_port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            return int(fields[4].split(":")[0], 16)
    return None


def stalled_sse(server: Server, case: Case) -> Outcome:
    """A stream whose client reads the status line, then nothing. Dropped (its request ended) within the window:
    a pass. Still decoding while the kernel queue stopped growing (the server's writes block and its output piles
    up in memory): a failure. Still decoding while the kernel still takes the output: not provoked here."""
    start = time.monotonic()
    sock = raw_request(server, case, rcvbuf=4096)
    try:
        status = sock.recv(64).split(b" ")[1].decode()
        if _wait_until(lambda: ours_running(server), START_WINDOW_S) is None:
            return Outcome(f"{status}, never seen running", time.monotonic() - start, status[:1] == "4")
        queues: list[tuple[float, int | None]] = []

        def gone() -> bool:
            queues.append((time.monotonic(), send_queue_bytes(server, sock.getsockname()[1])))
            return not ours_running(server)

        dropped = _wait_until(gone, STALL_WINDOW_S)
        if dropped is not None:
            return Outcome(f"{status}, dropped after {dropped:.1f} s", time.monotonic() - start, True)
        recent = [q for t, q in queues if t >= queues[-1][0] - 3.0 and q is not None]
        held = f"{status}, held {STALL_WINDOW_S:.0f} s, kernel queue {(recent or [0])[-1] // 1024} KB"
        if len(recent) > 2 and max(recent) == min(recent):
            return Outcome(held + " (full)", time.monotonic() - start, False)
        return Outcome(held + " and filling", time.monotonic() - start, None)
    finally:
        sock.close()


def _answered(sock: socket.socket) -> bool:
    """Whether the server has written to `sock` (or closed it): a request refused before it ran."""
    return bool(select.select([sock], [], [], 0)[0])


def _status_now(sock: socket.socket) -> str:
    """The status the server has answered on `sock`, if it has."""
    sock.settimeout(2)
    try:
        return sock.recv(64)[9:12].decode(errors="replace") or "closed"
    except OSError:
        return "no answer"


def disconnect(server: Server, case: Case, after_first_event: bool) -> Outcome:
    """The client leaves after the first streamed event, or once the request holds its slots (while it prefills);
    the request must stop. One refused (4xx) before it ever ran is fine too."""
    start = time.monotonic()
    sock = raw_request(server, case)
    try:
        if after_first_event:
            seen = b""
            while b"data:" not in seen and time.monotonic() - start < 30:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                seen += chunk
        elif _wait_until(lambda: _answered(sock) or ours_running(server), START_WINDOW_S) is None or _answered(sock):
            status = _status_now(sock)
            return Outcome(f"never seen running: {status}", time.monotonic() - start, status[:1] == "4")
    finally:
        sock.close()
    left = time.monotonic()
    stopped = _wait_until(lambda: not ours_running(server), DISCONNECT_WINDOW_S)
    if stopped is None:
        return Outcome(f"still running {DISCONNECT_WINDOW_S:.0f} s after the client left",
                       time.monotonic() - start, False)
    return Outcome(f"stopped {stopped:.1f} s after the client left", time.monotonic() - left, True, left - start)


def lora_oracle(server: Server, case: Case) -> Outcome:
    """Loading a missing path and loading a file that is not an adapter must answer alike (paths masked)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        missing, not_adapter = Path(folder, "missing.gguf"), Path(folder, "notes.gguf")
        not_adapter.write_text("not a LoRA adapter\n" * 64)
        answers = []
        for path in (missing, not_adapter):
            response = httpx.post(f"{server.base}{case.path}", content=encode({"lora_name": "hostile",
                                                                                "lora_path": str(path)}),
                                  headers={**AUTH, "content-type": "application/json"}, timeout=30)
            answers.append((response.status_code, response.text.replace(str(path), "<path>")))
    (status_a, text_a), (status_b, text_b) = answers
    status = f"{status_a} vs {status_b}" if (status_a, text_a) != (status_b, text_b) else f"{status_a} both"
    return Outcome(status, time.monotonic() - start, (status_a, text_a) == (status_b, text_b) and status_a < 500)


SPECIAL: dict[str, Callable[[Server, Case], Outcome]] = {
    "stalled_sse": stalled_sse,
    "disconnect_decode": lambda server, case: disconnect(server, case, after_first_event=True),
    "disconnect_prefill": lambda server, case: disconnect(server, case, after_first_event=False),
    "lora_oracle": lora_oracle,
}
