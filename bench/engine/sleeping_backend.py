"""How busy the engine keeps a GPU-like backend, and what it delivers: the backend sleeps a fixed time per
decode (time.sleep releases the GIL, as a real decode's ctypes call does) and returns its greedy tokens as a
GPU backend would, without the host reading the logits (host_overhead.py's NullBackend, --device-argmax).

    .venv/bin/python bench/engine/sleeping_backend.py                          # 64 and 256 in flight, engine only
    .venv/bin/python bench/engine/sleeping_backend.py --serve --seconds 10     # also through `cobali serve` (SSE)
    .venv/bin/python bench/engine/sleeping_backend.py --serve --stream-interval 4   # the server's --stream-interval

Closed loop: `concurrency` requests stay in flight (a finished one is replaced at once), each a short prompt
and `max_tokens` of ignore_eos output. Busy share = time the backend sleeps / wall time over the measured
window; overrun = how much longer than its sleep a decode call took (waking, and taking the GIL back);
tokens/s = tokens sampled (engine) or tokens received by the clients (server) per second. The server
runs in a child process, as `cobali serve` would, with clients in this one on raw sockets: each token is the
text "a", so the clients count the letters in the streamed texts, not the SSE events.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

from host_overhead import NullBackend

from cobali import Engine, EngineConfig, SamplingParams
from cobali.engine.plan import TickRecord
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo
from cobali.structured.compiler import GrammarCompiler

PROMPT = "a short prompt of some thirty-two characters"


class SleepingBackend(NullBackend):
    def __init__(self, n_slots: int, sleep_s: float, n_vocab: int) -> None:
        super().__init__(n_slots, max(512, n_slots), n_vocab, device_argmax=True)
        self.sleep_s = sleep_s

    def decode(self, tokens, positions, seq_ids, want_logits):
        time.sleep(self.sleep_s)
        return super().decode(tokens, positions, seq_ids, want_logits)


def build_engine(concurrency: int, sleep_s: float, n_vocab: int, overlap: bool = False) -> Engine:
    backend = SleepingBackend(concurrency, sleep_s, n_vocab)
    # Passed only when set, so this file also runs on checkouts that predate it.
    overlapped: dict[str, Any] = {"async_scheduling": True} if overlap else {}
    # As `cobali serve` runs it: each tick's record goes to on_tick, not into a list that the collector scans.
    config = EngineConfig(max_slots=concurrency, n_batch=backend.info.n_batch, record_ticks=False, **overlapped)
    return Engine(backend, config)


Tick = tuple[float, float, float, int]  # tick start, decode start, decode end, rows in the batch


def busy_share(ticks: list[Tick], t0: float, t1: float, sleep_s: float) -> float:
    """The share of [t0, t1) the backend works: a decode's sleep, not the time it then waits to run on."""
    inside = sum(max(0.0, min(t[1] + sleep_s, t1) - max(t[1], t0)) for t in ticks)
    return inside / (t1 - t0)


def rows_per_tick(ticks: list[Tick], t0: float, t1: float) -> float:
    """Requests in a batch on average: below the concurrency when slots wait for their next request."""
    rows = [t[3] for t in ticks if t0 <= t[1] < t1]
    return sum(rows) / max(1, len(rows))


def measured(ticks: list[Tick], t0: float, t1: float, sleep_s: float) -> dict:
    """Also how long a decode overran its sleep: waking up, and taking the GIL back from whoever holds it
    (in the server, the event loop's thread)."""
    window = [t for t in ticks if t0 <= t[1] < t1]
    overrun = sum(t[2] - t[1] for t in window) / max(1, len(window)) - sleep_s
    return {"busy": busy_share(ticks, t0, t1, sleep_s), "rows_per_tick": rows_per_tick(ticks, t0, t1),
            "tick_ms": (t1 - t0) / max(1, len(window)) * 1e3, "overrun_ms": overrun * 1e3}


def run_engine(concurrency: int, sleep_s: float, seconds: float, max_tokens: int, n_vocab: int,
               overlap: bool = False) -> dict:
    engine = build_engine(concurrency, sleep_s, n_vocab, overlap=overlap)
    ticks: list[Tick] = []
    sampled: list[tuple[float, int]] = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def on_tick(r: TickRecord) -> None:
        ticks.append((r.start, r.decode_start, r.decode_end, len(r.plan.chunks)))
        sampled.append((r.end, sum(c.yields_token for c in r.plan.chunks)))
        # Refilled here, on the thread that publishes ticks (the host thread with async scheduling): in the
        # server, requests come from the event loop's thread, not from the one that launches the decodes.
        for _ in range(concurrency - engine.n_live):
            engine.add_request(PROMPT, params)

    engine.on_tick = on_tick
    for _ in range(concurrency):
        engine.add_request(PROMPT, params)
    start = time.perf_counter()
    t0, t1 = start + seconds / 4, start + seconds  # the first quarter fills the slots: not measured
    while time.perf_counter() < t1:
        engine.step()
    tokens = sum(n for t, n in sampled if t0 <= t < t1)
    return {"concurrency": concurrency, "path": "engine" + " async" * overlap, **measured(ticks, t0, t1, sleep_s),
            "tokens_per_s": tokens / (t1 - t0)}


# ---- through the server -----------------------------------------------------------------------------

TICKS: list[Tick] = []  # in the process that runs the engine: the server's, or the engine's own


def timed_engine(concurrency: int, sleep_s: float, n_vocab: int, overlap: bool, ticks_file: str) -> Engine:
    """The server's engine, its ticks' times kept in TICKS and written to ticks_file when its process ends.
    Module-level: an engine in a process of its own is built by name."""
    engine = build_engine(concurrency, sleep_s, n_vocab, overlap=overlap)
    close_tick = engine.close_tick

    def keep_times(record: TickRecord, seconds: float | None) -> None:
        # The server's metrics own on_tick: the times are taken on the way to it.
        TICKS.append((record.start, record.decode_start, record.decode_end, len(record.plan.chunks)))
        close_tick(record, seconds)

    engine.close_tick = keep_times  # type: ignore[method-assign]
    atexit.register(dump_ticks, ticks_file)
    return engine


def dump_ticks(ticks_file: str) -> None:
    with open(ticks_file, "w") as f:
        json.dump(TICKS, f)


def null_text_side(concurrency: int, n_vocab: int, model: ModelInfo) -> tuple[Tokenizer, GrammarCompiler]:
    """The frontend's own vocabulary, when the engine runs in a process of its own."""
    vocabulary = SleepingBackend(concurrency, 0.0, n_vocab)
    return (Tokenizer(vocabulary, model.max_model_len, model.context_hint),
            GrammarCompiler(vocabulary.guidance_tokenizer))


def serve_child(port: int, concurrency: int, sleep_s: float, n_vocab: int, ticks_file: str,
                stream_interval: int, overlap: bool, engine_process: bool) -> None:
    """The child process: the server's app around a sleeping engine (on a thread of its own, or in a process of
    its own); its decode times go to ticks_file."""
    import signal

    import uvicorn

    from cobali.frontend.client import EngineClient
    from cobali.frontend.engine_process import ProcessCore
    from cobali.frontend.transports import ThreadCore, Transport
    from cobali.http.app import create_app
    from cobali.http.config import ServerConfig
    from cobali.http.serve import configure_logging

    factory = functools.partial(timed_engine, concurrency, sleep_s, n_vocab, overlap, ticks_file)
    transport: Transport = (ProcessCore(factory, lambda: functools.partial(null_text_side, concurrency, n_vocab))
                            if engine_process else ThreadCore(factory))

    def stop(*_args) -> None:
        if not engine_process:  # else the engine's process writes them as it ends, its server gone
            dump_ticks(ticks_file)
        os._exit(0)

    signal.signal(signal.SIGUSR1, stop)
    config = ServerConfig(served_model_name="sleeping", max_queue=4 * concurrency, stream_interval=stream_interval)
    app = create_app(config, EngineClient(transport, max_queue=config.max_queue, stream_interval=stream_interval))
    configure_logging()  # a line per request and uvicorn's access log, as `cobali serve` writes them
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="info")


TEXT = re.compile(rb'"text":"(a*)"')  # the sleeping backend renders every token as "a": text length = tokens
END_OF_BODY = b"\r\n0\r\n\r\n"  # the last chunk of a chunked reply


async def stream_clients(port: int, concurrency: int, seconds: float, max_tokens: int) -> list[tuple[float, int]]:
    """Closed-loop SSE clients on raw keep-alive sockets; returns (arrival time, tokens) per socket read.

    A client must cost far less per token than the server, or it measures itself: no HTTP library, no
    per-event parsing, one regex over each read that counts the tokens in it (an SSE event may carry several).
    """
    body = json.dumps({"model": "sleeping", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    arrivals: list[tuple[float, int]] = []
    failures: list[str] = []
    deadline = time.perf_counter() + seconds

    async def one_client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < deadline:
                writer.write(head + body)
                pending = b""  # the bytes after the last complete event, which may end inside a "text"
                while True:
                    data = pending + await reader.read(65536)
                    if not data:
                        raise ConnectionError("the server closed the connection")
                    cut = data.rfind(b"\n\n") + 1
                    complete, pending = data[:cut], data[cut:]
                    if complete:
                        arrivals.append((time.perf_counter(), sum(map(len, TEXT.findall(complete)))))
                    if data.endswith(END_OF_BODY):
                        break
        except (ConnectionError, OSError) as err:  # counted, not fatal: a starved client may lose a connection
            failures.append(str(err))
        finally:
            writer.close()

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    if failures:
        print(f"  {len(failures)} streams lost their connection: {failures[0]}", file=sys.stderr)
    return arrivals


def wait_healthy(port: int, timeout_s: float = 60) -> None:
    import httpx

    end = time.perf_counter() + timeout_s
    while time.perf_counter() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up")


def run_server(concurrency: int, sleep_s: float, seconds: float, max_tokens: int, n_vocab: int, port: int,
               stream_interval: int, overlap: bool = False, engine_process: bool = False) -> dict:
    ticks_file = tempfile.mktemp(suffix=".json")
    with tempfile.TemporaryFile("w+") as log:  # the server's log lines (and access log), shown only if it fails
        child = subprocess.Popen([sys.executable, __file__, "--child", str(port), "--concurrency", str(concurrency),
                                  "--sleep-ms", str(sleep_s * 1e3), "--n-vocab", str(n_vocab), "--ticks-file",
                                  ticks_file, "--stream-interval", str(stream_interval)]
                                 + ["--async-scheduling"] * overlap + ["--engine-process"] * engine_process,
                                 stdout=log, stderr=log)
        try:
            wait_healthy(port)
            start, server_cpu, client_cpu = time.perf_counter(), cpu_seconds(child.pid), time.process_time()
            arrivals = asyncio.run(stream_clients(port, concurrency, seconds, max_tokens))
            wall = time.perf_counter() - start
            server_cpu = (cpu_seconds(child.pid) - server_cpu) / wall
            client_cpu = (time.process_time() - client_cpu) / wall
            per_token_us = server_cpu * wall / max(1, sum(n for _, n in arrivals)) * 1e6
        except Exception:
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            raise
        finally:
            child.send_signal(__import__("signal").SIGUSR1)
            child.wait(30)
    for _ in range(100):  # an engine in its own process writes them once it sees its server gone
        if os.path.exists(ticks_file) and os.path.getsize(ticks_file):
            break
        time.sleep(0.1)
    with open(ticks_file) as f:
        ticks = [tuple(t) for t in json.load(f)]
    os.unlink(ticks_file)
    t0, t1 = start + seconds / 4, start + seconds
    delivered = sum(n for t, n in arrivals if t0 <= t < t1)
    path = "server" + " async" * overlap + " process" * engine_process
    return {"concurrency": concurrency, "path": path, **measured(ticks, t0, t1, sleep_s),
            "tokens_per_s": delivered / (t1 - t0), "server_cpu": server_cpu, "client_cpu": client_cpu,
            "server_cpu_us_per_token": per_token_us}


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process, or of one of its threads (native id), so far (Linux /proc): is the
    server or the client the limit?"""
    with open(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--sleep-ms", type=float, default=5.0, help="what one decode costs the backend")
    parser.add_argument("--seconds", type=float, default=8.0, help="run time per point; the first quarter warms up")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n-vocab", type=int, default=49152)
    parser.add_argument("--serve", action="store_true", help="also measure through the HTTP server")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run the engine with async scheduling (the next tick planned during the decode), "
                             "and the server with it")
    parser.add_argument("--engine-process", action="store_true",
                        help="the server's engine in a process of its own (as `cobali serve --engine-process`)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ticks-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sleep_s = args.sleep_ms / 1e3
    if args.child is not None:
        serve_child(args.child, args.concurrency[0], sleep_s, args.n_vocab, args.ticks_file, args.stream_interval,
                    args.async_scheduling, args.engine_process)
        return
    rows = []
    print(f"{'path':>12} {'in flight':>9} {'backend busy':>13} {'rows/tick':>9} {'tick ms':>7} {'overrun ms':>10} "
          f"{'tokens/s':>9}")
    for n in args.concurrency:
        paths = [run_engine(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab)]
        if args.async_scheduling:
            paths.append(run_engine(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab, overlap=True))
        if args.serve:
            paths.append(run_server(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab, args.port,
                                    args.stream_interval, args.async_scheduling, args.engine_process))
        for row in paths:
            rows.append(row)
            cpu = (f"  CPU cores used: server {row['server_cpu']:.2f}, clients {row['client_cpu']:.2f}; "
                   f"server {row['server_cpu_us_per_token']:.0f} µs a token" if "server_cpu" in row else "")
            print(f"{row['path']:>12} {n:>9} {row['busy']:>12.1%} {row['rows_per_tick']:>9.1f} {row['tick_ms']:>7.2f} "
                  f"{row['overrun_ms']:>10.2f} {row['tokens_per_s']:>9.0f}{cpu}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
