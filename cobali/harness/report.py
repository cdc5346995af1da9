"""Turning runs into numbers: per-config summaries, the comparison table, host-gap statistics, files."""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

from cobali.engine.costs import TickTerms
from cobali.engine.plan import TickRecord
from cobali.harness.configs import BenchRun
from cobali.harness.latency import LATENCIES, percentile_stats, request_record, write_json

# (header, summary key, format); a missing or None value prints as "-".
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("wall s", "wall_s", ".2f"),
    ("CPU s", "user_cpu_s", ".2f"),
    ("req/s", "requests_per_s", ".2f"),
    ("out tok/s", "output_tok_s", ".1f"),
    ("tot tok/s", "total_tok_s", ".1f"),
    ("speedup", "speedup", ".2f"),
    *((f"{m.upper()} {p}", f"{m}_{p}_ms", ".1f") for m in LATENCIES for p in ("p50", "p99")),
    ("wasted", "wasted_decode_slots", "d"),
    ("ticks", "ticks", "d"),
    ("tok/tick", "mean_batch_tokens", ".1f"),
)
GAP_STATS = ("count", "mean", "p50", "p75", "p90", "p95", "max")


def gaps_ms(ticks: Sequence[TickRecord], idle_after: frozenset[int] = frozenset()) -> list[float]:
    """Host time between consecutive forwards: next.decode_start - this.decode_end, skipping gaps where the
    engine slept waiting for an arrival (open loop)."""
    return [(b.decode_start - a.decode_end) * 1e3
            for i, (a, b) in enumerate(itertools.pairwise(ticks)) if i not in idle_after]


def run_summary(run: BenchRun) -> dict:
    summary = {"config": run.config.name, **run.result.summary()}
    summary["gap_ms"] = percentile_stats(gaps_ms(run.result.ticks, run.result.idle_after))
    summary["engine"] = asdict(run.config)
    return summary


def add_speedups(summaries: list[dict]) -> list[dict]:
    """Speedup is output throughput relative to the first row (the same workload, so also 1 / wall ratio
    when every config generates the same tokens)."""
    base = summaries[0]["output_tok_s"] if summaries else 0.0
    for s in summaries:
        s["speedup"] = s["output_tok_s"] / base if base else None
    return summaries


def _cell(value: object, fmt: str) -> str:
    if value is None:
        return "-"
    return format(value, fmt) if isinstance(value, int | float) else str(value)


def format_table(summaries: Sequence[dict]) -> str:
    width = max([len("config")] + [len(s["config"]) for s in summaries])
    widths = [max(len(h), 9) for h, _, _ in COLUMNS]

    def line(first: str, cells: Iterable[str]) -> str:
        return f"{first:<{width}}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths, strict=True))

    lines = [line("config", (h for h, _, _ in COLUMNS))]
    lines += [line(s["config"], (_cell(s.get(key), fmt) for _, key, fmt in COLUMNS)) for s in summaries]
    lines.append("latencies in ms; speedup = output tok/s relative to the first config")
    return "\n".join(lines)


def format_gaps(summaries: Sequence[dict]) -> str:
    width = max([len("host gap (ms)")] + [len(s["config"]) for s in summaries])
    lines = [f"{'host gap (ms)':<{width}}" + "".join(f" {h:>9}" for h in GAP_STATS)]
    for s in summaries:
        gaps = s.get("gap_ms", {})
        cells = (_cell(gaps.get(h), "d" if h == "count" else ".3f") for h in GAP_STATS)
        lines.append(f"{s['config']:<{width}}" + "".join(f" {c:>9}" for c in cells))
    return "\n".join(lines)


def tick_rows(ticks: Sequence[TickRecord]) -> list[dict]:
    """One profiling row per tick, times in ms from the run's first tick."""
    t0 = ticks[0].start if ticks else 0.0
    rows = []
    for i, t in enumerate(ticks):
        after = ticks[i + 1].decode_start - t.decode_end if i + 1 < len(ticks) else None
        rows.append({
            "tick": t.plan.tick, "start_ms": (t.start - t0) * 1e3, "end_ms": (t.end - t0) * 1e3,
            "decode_ms": t.decode_s * 1e3, "host_before_ms": (t.decode_start - t.start) * 1e3,
            "host_after_ms": (t.end - t.decode_end) * 1e3,
            "gap_to_next_ms": None if after is None else after * 1e3,
            "decode_rows": t.plan.n_decode, "prefill_rows": t.plan.n_prefill_tokens, "slot_runs": t.plan.slot_runs,
            "decode_kv_tokens": TickTerms.of_plan(t.plan).decode_kv_tokens,
            "n_running": t.n_running, "n_waiting": t.n_waiting,
        })
    return rows


def write_ticks_csv(path: Path, ticks: Sequence[TickRecord]) -> Path:
    rows = tick_rows(ticks)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["tick"])
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_offline_files(out: Path, meta: dict, runs: Sequence[BenchRun],
                        summaries: Sequence[dict]) -> list[Path]:
    """summary.json, and per config the request records and the per-tick profile."""
    written = [write_json(out / "summary.json", {**meta, "runs": list(summaries)})]
    for run in runs:
        name = run.config.name
        records = [request_record(r) for r in run.result.outputs]
        written.append(write_json(out / f"requests_{name}.json", records))
        written.append(write_ticks_csv(out / f"ticks_{name}.csv", run.result.ticks))
    return written
