"""`cobali bench serve --sweep`: one server (or several in turn) under Poisson arrivals at each of a list of
rates; goodput under SLOs as `vllm bench serve` defines it; and a capacity search, the highest rate at which
the p99 targets still hold.

Goodput (vLLM's definition): completed requests per second of the run whose every named SLO holds, with
TTFT = first text chunk - send, E2EL = end - send, and TPOT = (E2EL - TTFT) / (output tokens - 1), 0 for a
one-token output. Capacity: a rate passes when TTFT p99 and TPOT p99 over its run are within their limits;
between the highest passing and the lowest failing rate the search bisects `steps` times.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from cobali.harness.serve_client import ClientRecord, ServeResult

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
CAPACITY_METRICS = ("ttft_p99", "tpot_p99")


def parse_limits(text: str, known: Sequence[str], flag: str) -> dict[str, float]:
    """'ttft:500,tpot:50' (or space separated, as vLLM's --goodput) -> {'ttft': 500.0, 'tpot': 50.0} (ms)."""
    limits: dict[str, float] = {}
    for part in text.replace(",", " ").split():
        name, sep, value = part.partition(":")
        if not sep or name not in known:
            raise ValueError(f"{flag} {part!r}: expected NAME:MS with NAME one of {', '.join(known)}")
        try:
            limits[name] = float(value)
        except ValueError:
            raise ValueError(f"{flag} {part!r}: {value!r} is not a number of ms") from None
        if not limits[name] > 0:
            raise ValueError(f"{flag} {part!r}: the limit must be > 0 ms")
    if not limits:
        raise ValueError(f"{flag}: expected at least one NAME:MS")
    return limits


def parse_rates(text: str) -> tuple[float, ...]:
    """'0.2,0.35,0.5' -> request rates (req/s), ascending; 'inf' is all at once."""
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--sweep {text!r}: expected comma-separated request rates (req/s)") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--sweep {text!r}: expected comma-separated request rates > 0 (req/s)")
    return tuple(rates)


def slo_metrics(record: ClientRecord) -> dict[str, float]:
    """A completed request's TTFT, TPOT and E2EL (ms) as vLLM's goodput reads them."""
    timing = record.timing()
    assert timing.ttft_ms is not None and timing.e2el_ms is not None, "only completed requests are judged"
    n = record.output_tokens
    tpot = (timing.e2el_ms - timing.ttft_ms) / (n - 1) if n > 1 else 0.0
    return {"ttft": timing.ttft_ms, "tpot": tpot, "e2el": timing.e2el_ms}


def goodput(result: ServeResult, limits: dict[str, float]) -> float:
    """Requests per second that completed within every limit (ms)."""
    completed = [r for r in result.records if r.error is None and r.chunk_times]
    good = sum(all(slo_metrics(r)[name] <= limit for name, limit in limits.items()) for r in completed)
    return good / result.wall_s if result.wall_s > 0 else 0.0


def meets(summary: dict, slo: dict[str, float]) -> bool:
    """Does a run's summary hold every p99 target (e.g. {'ttft_p99': 5000, 'tpot_p99': 150}, ms)?"""
    if summary.get("failed"):
        return False
    values = [summary.get(f"{name}_ms") for name in slo]
    return all(v is not None and v <= slo[name] for name, v in zip(slo, values, strict=True))


@dataclass(frozen=True)
class Capacity:
    rate: float | None  # the highest rate that held the SLO; None when even the lowest failed
    bounded: bool  # a failing rate was found above it (else capacity is at least `rate`)
    tried: tuple[tuple[float, bool], ...]  # (rate, held) in the order they ran

    def describe(self) -> str:
        if self.rate is None:
            return f"below {min(r for r, _ in self.tried):g} req/s (every rate tried missed the SLO)"
        return f"{self.rate:.3g} req/s" if self.bounded else f">= {self.rate:.3g} req/s (no rate tried failed)"


@dataclass
class CapacitySearch:
    """One server's capacity search, fed one result at a time so that several servers' runs can interleave:
    the sweep's rates, then bisection between the highest passing and the lowest failing rate above it
    (geometric midpoints: rates span orders of magnitude)."""

    tried: list[tuple[float, bool]] = field(default_factory=list)  # (rate, held) in the order they ran

    def record(self, rate: float, held: bool) -> None:
        self.tried.append((rate, held))

    def bounds(self) -> tuple[float | None, float | None]:
        """The highest passing rate and the lowest failing one above it (None where there is none)."""
        passed = [r for r, held in self.tried if held]
        low = max(passed) if passed else None
        failed = [r for r, held in self.tried if not held and (low is None or r > low)]
        return low, (min(failed) if failed else None)

    def midpoint(self) -> float | None:
        """The next rate to try, or None while no passing rate lies below a finite failing one."""
        low, high = self.bounds()
        if low is None or high is None or math.isinf(high):
            return None
        return math.sqrt(low * high)

    def capacity(self) -> Capacity:
        low, high = self.bounds()
        return Capacity(low, high is not None, tuple(self.tried))


def sweep_row(rate: float, result: ServeResult, limits: dict[str, float] | None) -> dict:
    row = {"rate": rate, **result.summary()}
    if limits:
        row["goodput_req_s"] = goodput(result, limits)
    return row


def combine_repeats(rows: Sequence[dict]) -> dict:
    """Runs repeated at one rate as one row: every number the median of the runs (failures summed), `noise`
    the half-spread of each number relative to its median (the run-to-run noise to quote beside it), and
    `runs` the runs themselves, each with its arrival seed, for ratios paired run by run."""
    if len(rows) == 1:
        return dict(rows[0])
    merged = {key: value for key, value in rows[0].items() if key != "seed"}
    noise: dict[str, float] = {}
    for key in list(merged):
        values = [r.get(key) for r in rows]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if key == "rate" or len(numbers) < len(values):
            continue
        merged[key] = statistics.median(numbers)
        if merged[key]:
            noise[key] = (max(numbers) - min(numbers)) / 2 / abs(merged[key])
    merged["failed"] = sum(r["failed"] for r in rows)
    return {**merged, "repeats": len(rows), "noise": noise, "runs": [dict(row) for row in rows]}
