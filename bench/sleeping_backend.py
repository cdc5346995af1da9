"""How busy the engine keeps a GPU-like backend, and what it delivers: the backend sleeps a fixed time per
decode (time.sleep releases the GIL, as a real decode's ctypes call does) and returns its greedy tokens as a
GPU backend would, without the host reading the logits (host_overhead.py's NullBackend, --device-argmax).

    .venv/bin/python bench/sleeping_backend.py                          # 64 and 256 in flight, engine only
    .venv/bin/python bench/sleeping_backend.py --serve --seconds 10     # also through `cobali serve` (SSE)

Closed loop: `concurrency` requests stay in flight (a finished one is replaced at once), each a short prompt
and `max_tokens` of ignore_eos output. Busy share = time inside decode / wall time over the measured window;
tokens/s = tokens sampled (engine) or text chunks received by the clients (server) per second. The server
runs in a child process, as `cobali serve` would, with clients in this one reading raw SSE lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

from host_overhead import NullBackend

from cobali import Engine, EngineConfig, SamplingParams

PROMPT = "a short prompt of some thirty-two characters"


class SleepingBackend(NullBackend):
    def __init__(self, n_slots: int, sleep_s: float, n_vocab: int) -> None:
        super().__init__(n_slots, max(512, n_slots), n_vocab, device_argmax=True)
        self.sleep_s = sleep_s

    def decode(self, tokens, positions, seq_ids, want_logits):
        time.sleep(self.sleep_s)
        return super().decode(tokens, positions, seq_ids, want_logits)


def build_engine(concurrency: int, sleep_s: float, n_vocab: int, record_ticks: bool = False,
                 overlap: bool = False) -> Engine:
    backend = SleepingBackend(concurrency, sleep_s, n_vocab)
    config = EngineConfig(max_slots=concurrency, n_batch=backend.info.n_batch, record_ticks=record_ticks,
                          async_scheduling=overlap)
    return Engine(backend, config)


def busy_share(ticks: list[tuple[float, float, float]], t0: float, t1: float) -> float:
    """ticks: (tick start, decode start, decode end); the share of [t0, t1) spent inside decode."""
    inside = sum(max(0.0, min(t[2], t1) - max(t[1], t0)) for t in ticks)
    return inside / (t1 - t0)


def run_engine(concurrency: int, sleep_s: float, seconds: float, max_tokens: int, n_vocab: int,
               overlap: bool = False) -> dict:
    engine = build_engine(concurrency, sleep_s, n_vocab, overlap=overlap)
    ticks: list[tuple[float, float, float]] = []
    sampled: list[tuple[float, int]] = []
    engine.on_tick = lambda r: (ticks.append((r.start, r.decode_start, r.decode_end)),
                                sampled.append((r.end, sum(c.yields_token for c in r.plan.chunks))))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for _ in range(concurrency):
        engine.add_request(PROMPT, params)
    start = time.perf_counter()
    t0, t1 = start + seconds / 4, start + seconds  # the first quarter fills the slots: not measured
    while time.perf_counter() < t1:
        engine.step()
        for _ in range(concurrency - len(engine.requests)):
            engine.add_request(PROMPT, params)
    tokens = sum(n for t, n in sampled if t0 <= t < t1)
    return {"concurrency": concurrency, "path": "engine" + " async" * overlap, "busy": busy_share(ticks, t0, t1),
            "tokens_per_s": tokens / (t1 - t0)}


# ---- through the server -----------------------------------------------------------------------------

def serve_child(port: int, concurrency: int, sleep_s: float, n_vocab: int, ticks_file: str) -> None:
    """The child process: the server's app around a sleeping engine; its decode times go to ticks_file."""
    import signal

    import uvicorn

    from cobali.server.app import create_app

    engines: list[Engine] = []  # the server's metrics own on_tick: the engine records its ticks instead

    def factory() -> Engine:
        engines.append(build_engine(concurrency, sleep_s, n_vocab, record_ticks=True))
        return engines[0]

    def dump(*_args) -> None:
        with open(ticks_file, "w") as f:
            json.dump([(r.start, r.decode_start, r.decode_end, len(r.plan.chunks)) for r in engines[0].ticks], f)
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    app = create_app(factory, "sleeping", max_queue=4 * concurrency)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def stream_clients(port: int, concurrency: int, seconds: float, max_tokens: int) -> list[float]:
    """Closed-loop SSE clients; returns the arrival time of every text chunk."""
    import httpx

    arrivals: list[float] = []
    failures: list[float] = []
    deadline = time.perf_counter() + seconds
    body = {"model": "sleeping", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=60) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as reply:
                        async for line in reply.aiter_lines():
                            if line.startswith("data: {"):
                                arrivals.append(time.perf_counter())
                except httpx.TransportError:  # counted, not fatal: a starved client may lose a connection
                    failures.append(time.perf_counter())

        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    if failures:
        print(f"  {len(failures)} streams lost their connection", file=sys.stderr)
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


def run_server(concurrency: int, sleep_s: float, seconds: float, max_tokens: int, n_vocab: int, port: int) -> dict:
    ticks_file = tempfile.mktemp(suffix=".json")
    child = subprocess.Popen([sys.executable, __file__, "--child", str(port), "--concurrency", str(concurrency),
                              "--sleep-ms", str(sleep_s * 1e3), "--n-vocab", str(n_vocab), "--ticks-file",
                              ticks_file])
    try:
        wait_healthy(port)
        start, server_cpu, client_cpu = time.perf_counter(), cpu_seconds(child.pid), time.process_time()
        arrivals = asyncio.run(stream_clients(port, concurrency, seconds, max_tokens))
        wall = time.perf_counter() - start
        server_cpu = (cpu_seconds(child.pid) - server_cpu) / wall
        client_cpu = (time.process_time() - client_cpu) / wall
    finally:
        child.send_signal(__import__("signal").SIGUSR1)
        child.wait(30)
    with open(ticks_file) as f:
        ticks = [tuple(t) for t in json.load(f)]
    os.unlink(ticks_file)
    t0, t1 = start + seconds / 4, start + seconds
    delivered = sum(t0 <= t < t1 for t in arrivals)
    return {"concurrency": concurrency, "path": "server", "busy": busy_share(ticks, t0, t1),
            "tokens_per_s": delivered / (t1 - t0), "server_cpu": server_cpu, "client_cpu": client_cpu}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): is the server or the client the limit?"""
    with open(f"/proc/{pid}/stat") as f:
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
                        help="also run the engine with async scheduling (the next tick planned during the decode)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ticks-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sleep_s = args.sleep_ms / 1e3
    if args.child is not None:
        serve_child(args.child, args.concurrency[0], sleep_s, args.n_vocab, args.ticks_file)
        return
    rows = []
    print(f"{'path':>12} {'in flight':>9} {'backend busy':>13} {'tokens/s':>9}")
    for n in args.concurrency:
        paths = [run_engine(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab)]
        if args.async_scheduling:
            paths.append(run_engine(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab, overlap=True))
        if args.serve:
            paths.append(run_server(n, sleep_s, args.seconds, args.max_tokens, args.n_vocab, args.port))
        for row in paths:
            rows.append(row)
            cpu = (f"  CPU cores used: server {row['server_cpu']:.2f}, clients {row['client_cpu']:.2f}"
                   if "server_cpu" in row else "")
            print(f"{row['path']:>12} {n:>9} {row['busy']:>12.1%} {row['tokens_per_s']:>9.0f}{cpu}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
