"""Chrome Trace Event format (JSON object form) for Perfetto / chrome://tracing.

One process per config, every config's clock starting at 0 so they line up side by side. Thread 0 holds
the ticks (a complete event each, with llama_decode nested inside) and counters of running/waiting
requests; every request gets a thread with its queued, prefill and decode spans.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from cobali.engine.outputs import RequestOutput
from cobali.harness.configs import BenchRun
from cobali.harness.driver import RunResult

TICK_TID = 0


def _meta(pid: int, tid: int, kind: str, name: str, sort: int) -> list[dict]:
    return [
        {"ph": "M", "pid": pid, "tid": tid, "name": f"{kind}_name", "args": {"name": name}},
        {"ph": "M", "pid": pid, "tid": tid, "name": f"{kind}_sort_index", "args": {"sort_index": sort}},
    ]


def _span(pid: int, tid: int, name: str, cat: str, start_us: float, end_us: float,
          args: dict | None = None) -> dict:
    event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat, "ts": start_us,
             "dur": round(max(0.0, end_us - start_us), 3)}
    if args:
        event["args"] = args
    return event


def _tick_events(pid: int, result: RunResult, us) -> list[dict]:
    events = []
    for t in result.ticks:
        args = {"decode_rows": t.plan.n_decode, "prefill_rows": t.plan.n_prefill_tokens,
                "n_running": t.n_running, "n_waiting": t.n_waiting, "plan": t.plan.describe()}
        events.append(_span(pid, TICK_TID, f"tick {t.plan.tick}", "tick", us(t.start), us(t.end), args))
        events.append(_span(pid, TICK_TID, "llama_decode", "decode", us(t.decode_start), us(t.decode_end)))
        events.append({"ph": "C", "pid": pid, "tid": TICK_TID, "name": "requests", "ts": us(t.start),
                       "args": {"running": t.n_running, "waiting": t.n_waiting}})
    return events


def _request_events(pid: int, output: RequestOutput, us) -> list[dict]:
    stats = output.stats
    if stats is None or stats.first_scheduled_time is None:
        return []  # never ran (rejected at submit): nothing to draw
    tid = output.request_id + 1
    first_token = stats.token_times[0] if stats.token_times else stats.finish_time
    args = {"prompt_tokens": stats.n_prompt_tokens, "output_tokens": stats.n_output_tokens}
    events = _meta(pid, tid, "thread", f"req {output.request_id}", tid)
    scheduled = us(stats.first_scheduled_time)
    events.append(_span(pid, tid, "queued", "request", us(stats.arrival_time), scheduled))
    events.append(_span(pid, tid, "prefill", "request", scheduled, us(first_token), args))
    if stats.token_times:
        events.append(_span(pid, tid, "decode", "request", us(first_token), us(stats.finish_time), args))
    return events


def run_events(pid: int, name: str, result: RunResult) -> list[dict]:
    starts = [o.stats.arrival_time for o in result.outputs if o.stats] + [t.start for t in result.ticks[:1]]
    t0 = min(starts, default=0.0)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events = _meta(pid, TICK_TID, "process", name, pid)
    events += _meta(pid, TICK_TID, "thread", "engine ticks", TICK_TID)
    events += _tick_events(pid, result, us)
    for output in result.outputs:
        events += _request_events(pid, output, us)
    return events


def build_trace(runs: Sequence[BenchRun]) -> dict:
    events = [e for pid, run in enumerate(runs) for e in run_events(pid, run.config.name, run.result)]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, runs: Sequence[BenchRun]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_trace(runs), separators=(",", ":")))
    return path
