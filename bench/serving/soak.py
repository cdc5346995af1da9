"""Soak test: many streamed completions against a live server, a share of them cancelled mid-stream, then a
check that nothing leaked (slots, KV, queue) and that the server's memory stayed put.

    .venv/bin/python bench/serving/soak.py                      # starts `cobali serve` on the embedded model
    .venv/bin/python bench/serving/soak.py --url http://127.0.0.1:8000 --pid 1234

Every request uses ignore_eos and a fixed max_tokens, so a completed one must report exactly max_tokens
completion tokens. Outcomes: completed; cancelled (the client closed the stream on purpose); failed (a clean
error: an HTTP error status, an SSE error event, a refused connection or one closed before any response);
lost (anything else: a wrong token count, a stream cut or ended without [DONE] or an error, a timeout).
Exits 1 when anything was lost or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from cobali.harness.serve_client import sse_data

COBALI = str(Path(sys.executable).with_name("cobali"))


@dataclass(frozen=True)
class SoakOptions:
    requests: int = 2000
    concurrency: int = 64
    max_tokens: int = 8
    cancel_fraction: float = 0.25
    seed: int = 0
    request_timeout_s: float = 120.0
    time_limit_s: float = 900.0  # the whole run; requests still open then count as lost
    settle_s: float = 10.0  # how long aborted requests get to release their slots


@dataclass
class SoakReport:
    outcomes: Counter[str] = field(default_factory=Counter)  # completed / cancelled / failed / lost
    reasons: Counter[str] = field(default_factory=Counter)  # why requests failed or were lost
    leaked_slots: int = 0
    residue: dict[str, float] = field(default_factory=dict)  # running, waiting, kv usage after the run
    rss_kib: tuple[int, int] | None = None  # server RSS before and after
    elapsed_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.outcomes["lost"]

    @property
    def clean(self) -> bool:
        return self.lost == 0 and self.leaked_slots == 0 and not any(self.residue.values())

    def lines(self, sent: int) -> list[str]:
        o = self.outcomes
        lines = [f"sent {sent}  completed {o['completed']}  cancelled {o['cancelled']}  failed {o['failed']}  "
                 f"lost {o['lost']}  leaked slots {self.leaked_slots}  in {self.elapsed_s:.1f} s",
                 "residue: " + "  ".join(f"{k} {v:g}" for k, v in self.residue.items())]
        if self.rss_kib is not None:
            before, after = self.rss_kib
            lines.append(f"server RSS before {before / 1024:.1f} MiB  after {after / 1024:.1f} MiB  "
                         f"growth {(after - before) / 1024:+.1f} MiB")
        lines += [f"  {n} x {reason}" for reason, n in self.reasons.most_common(10)]
        return lines


def request_body(index: int, max_tokens: int) -> dict:
    return {"prompt": f"Soak request {index}: a few words about the number {index}.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


def _event(line: str) -> dict | str | None:
    """One SSE line: its JSON payload, the string '[DONE]', or None for a blank or comment line."""
    data = sse_data(line)
    return data if data is None or data == "[DONE]" else json.loads(data)


async def one_request(client: httpx.AsyncClient, index: int, max_tokens: int,
                      cancel_after: int | None) -> tuple[str, str]:
    """(outcome, reason). cancel_after: close the stream after that many text chunks."""
    chunks, usage, done, answered = 0, None, False, False
    try:
        async with client.stream("POST", "/v1/completions", json=request_body(index, max_tokens)) as response:
            answered = True
            if response.status_code != 200:
                return "failed", f"HTTP {response.status_code}"
            async for line in response.aiter_lines():
                event = _event(line)
                if event == "[DONE]":
                    done = True
                elif isinstance(event, dict):
                    if "error" in event:
                        return "failed", f"SSE error: {event['error'].get('message', '')[:80]}"
                    usage = event.get("usage") or usage
                    if any(c.get("text") for c in event.get("choices") or ()):
                        chunks += 1
                        if cancel_after is not None and chunks >= cancel_after:
                            return "cancelled", ""  # leaving the block closes the connection mid-stream
    except httpx.ConnectError:
        return "failed", "connection refused"
    except httpx.TransportError as err:
        if not answered:
            # Nothing came back: the server closed an idle keep-alive connection as the request went out
            # (uvicorn does at shutdown). The request was never taken, as with a refused connection.
            return "failed", "connection closed before a response"
        return "lost", f"{type(err).__name__} mid-stream"
    except json.JSONDecodeError:
        return "lost", "malformed SSE payload"
    if not done:
        return "lost", "stream ended without [DONE]"
    n_tokens = usage.get("completion_tokens") if usage else None
    if n_tokens != max_tokens:
        return "lost", f"completion_tokens {n_tokens}, expected {max_tokens}"
    return "completed", ""


async def run_load(url: str, options: SoakOptions, report: SoakReport) -> None:
    """Sends options.requests streams, at most options.concurrency at once, into report."""
    rng = random.Random(options.seed)
    plan = [rng.randint(1, max(1, options.max_tokens - 1)) if rng.random() < options.cancel_fraction else None
            for _ in range(options.requests)]
    gate = asyncio.Semaphore(options.concurrency)
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=options.concurrency)

    async def guarded(client: httpx.AsyncClient, index: int) -> None:
        async with gate:
            try:
                outcome, reason = await asyncio.wait_for(
                    one_request(client, index, options.max_tokens, plan[index]), options.request_timeout_s)
            except asyncio.TimeoutError:
                outcome, reason = "lost", "request timed out"
        report.outcomes[outcome] += 1
        if reason:
            report.reasons[reason] += 1

    async with httpx.AsyncClient(base_url=url, timeout=options.request_timeout_s, limits=limits) as client:
        tasks = [asyncio.create_task(guarded(client, i)) for i in range(options.requests)]
        _, pending = await asyncio.wait(tasks, timeout=options.time_limit_s)
        for task in pending:
            task.cancel()
        report.outcomes["lost"] += len(pending)
        if pending:
            report.reasons["still open at the time limit"] += len(pending)


def metric_values(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Unlabelled samples from a Prometheus text page."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name.removeprefix("cobali:")] = float(value)
    return values


RESIDUE_METRICS = ("cobali:num_requests_running", "cobali:num_requests_waiting", "cobali:kv_cache_usage_perc")


def check_idle(url: str, settle_s: float) -> tuple[int, dict[str, float]]:
    """(busy slots, residue metrics), polling up to settle_s for aborted requests to be swept up.

    kv_cache_usage_perc counts only requests holding a slot, not the prefix cache, so idle means 0."""
    deadline = time.monotonic() + settle_s
    with httpx.Client(base_url=url, timeout=10) as client:
        while True:
            busy = sum(bool(s["is_processing"]) for s in client.get("/slots").json())
            residue = metric_values(client.get("/metrics").text, RESIDUE_METRICS)
            if (busy == 0 and not any(residue.values())) or time.monotonic() > deadline:
                return busy, residue
            time.sleep(0.1)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for process {pid}")


def soak(url: str, options: SoakOptions, pid: int | None = None) -> SoakReport:
    """Warm up (so RSS 'before' includes one-off allocations), run the load, then check for leaks."""
    asyncio.run(run_load(url, SoakOptions(requests=options.concurrency, concurrency=options.concurrency,
                                          max_tokens=options.max_tokens, cancel_fraction=0), SoakReport()))
    before = rss_kib(pid) if pid is not None else None
    report = SoakReport()
    start = time.monotonic()
    asyncio.run(run_load(url, options, report))
    report.elapsed_s = time.monotonic() - start
    report.leaked_slots, report.residue = check_idle(url, options.settle_s)
    if pid is not None and before is not None:
        report.rss_kib = (before, rss_kib(pid))
    return report


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def started_process(command: Callable[[int], list[str]], startup_s: float = 120,
                    log: IO | int = subprocess.DEVNULL) -> Iterator[tuple[str, subprocess.Popen]]:
    """The HTTP server `command(port)` starts on a free loopback port, until its /health answers 200;
    terminated (SIGTERM) on exit."""
    port = free_port()
    proc = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy (exit status {proc.poll()})")
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def started_server(flags: list[str], startup_s: float = 120) -> AbstractContextManager[tuple[str, subprocess.Popen]]:
    """`cobali serve` with these flags, as started_process runs it."""
    return started_process(lambda port: [COBALI, "serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                           startup_s)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = SoakOptions()
    parser.add_argument("--url", help="an already running server (default: start `cobali serve`)")
    parser.add_argument("--pid", type=int, help="the --url server's process id, to watch its RSS")
    parser.add_argument("--serve-flags", default="--threads 1 --max-slots 16",
                        help="flags for the server this script starts")
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--cancel-fraction", type=float, default=defaults.cancel_fraction)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--time-limit", type=float, default=defaults.time_limit_s, help="seconds for the run")
    parser.add_argument("--max-rss-growth-mib", type=float, default=64.0,
                        help="fail when the server's RSS grew more than this over the run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url and not args.url.startswith(("http://127.0.0.1", "http://localhost", "http://[::1]")):
        print("refusing a non-loopback --url: this tool floods the server", file=sys.stderr)
        return 2
    options = SoakOptions(requests=args.requests, concurrency=args.concurrency, max_tokens=args.max_tokens,
                          cancel_fraction=args.cancel_fraction, seed=args.seed, time_limit_s=args.time_limit)
    if args.url:
        report = soak(args.url, options, args.pid)
    else:
        with started_server(shlex.split(args.serve_flags)) as (url, proc):
            report = soak(url, options, proc.pid)
    print("\n".join(report.lines(options.requests)))
    grown = report.rss_kib is not None and report.rss_kib[1] - report.rss_kib[0] > args.max_rss_growth_mib * 1024
    if grown:
        print(f"FAIL: RSS grew more than {args.max_rss_growth_mib} MiB")
    return 0 if report.clean and not grown else 1


if __name__ == "__main__":
    sys.exit(main())
