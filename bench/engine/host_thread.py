"""The async host thread's CPU per tick, doing what it does inside `cobali serve` (streaming every
--stream-interval tokens, the server's metrics and a log line per finished request) without the HTTP side:
the engine of sleeping_backend.py (5 ms decodes, GIL released), `concurrency` requests in flight, each one
replaced as it ends.

    .venv/bin/python bench/engine/host_thread.py                 # 256 in flight, 8 s
    .venv/bin/python bench/engine/host_thread.py --concurrency 64

Through the server the host thread shares the GIL with the event loop: what it costs per tick decides how
often a decode returns before the next batch is planned (the decode then waits for it).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from sleeping_backend import PROMPT, build_engine, cpu_seconds

from cobali import SamplingParams
from cobali.config.flags import positive_float, positive_int
from cobali.engine.core import settle_heap
from cobali.engine.messages import TickSummary
from cobali.engine.outputs import RequestOutput
from cobali.http.prometheus import ServerMetrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=positive_int, default=256)
    parser.add_argument("--seconds", type=positive_float, default=8.0,
                        help="measured time, after a quarter as long to fill")
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--stream-interval", type=positive_int, default=16)
    args = parser.parse_args()
    with open(os.devnull, "w") as sink:
        logging.basicConfig(level=logging.INFO, stream=sink)  # the log lines are formatted and written, not kept
        measure(args)


def measure(args: argparse.Namespace) -> None:
    engine = build_engine(args.concurrency, 0.005, 49152, overlap=True)
    metrics = ServerMetrics()
    metrics.attach(engine.stats)
    engine.on_tick = lambda record: metrics.tick_done(TickSummary.of(record))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def refill() -> None:
        for _ in range(args.concurrency - engine.n_live):
            engine.add_request(PROMPT, params, stream_interval=args.stream_interval)

    def on_outputs(outputs: list[RequestOutput]) -> None:  # on the host thread, as the server's client takes them
        finished = [output for output in outputs if output.finished]
        if finished:
            metrics.requests_finished(finished)
        refill()  # as the server's requests would come in

    engine.on_outputs = on_outputs
    refill()
    settle_heap()
    warm_until = time.perf_counter() + args.seconds / 4
    while time.perf_counter() < warm_until:
        engine.step()
    host = next(t for t in threading.enumerate() if t.name.startswith("cobali-host")).native_id
    pid = os.getpid()
    cpu0, start, ticks = cpu_seconds(pid, host), time.perf_counter(), 0
    while time.perf_counter() < start + args.seconds:
        engine.step()
        ticks += 1
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid, host) - cpu0
    print(f"{args.concurrency} in flight: host thread {cpu / ticks * 1e3:.3f} ms CPU per tick, "
          f"tick {wall / ticks * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
