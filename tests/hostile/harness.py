"""Sends each hostile case to the server beside the probe and checks issue 36's targets:
- every body is answered (a 4xx, or a 200 whose work is bounded) within 10 s;
- the probe (a normal 2-token request every 0.5 s) never waits more than 1 s beyond its usual time;
- the process never dies, and /health is 200 after each case;
- event-loop lag (the server's own timer, cobali:event_loop_lag_*) stays at or under 50 ms.
A case that kills or wedges the server is recorded, and a fresh server takes the next case.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from dataclasses import dataclass, field

import httpx

from tests.hostile.corpus import BOUNDED, Case
from tests.hostile.server import AUTH, Probe, Server
from tests.hostile.streams import SPECIAL, Outcome, ours_running

ANSWER_WITHIN_S = 10.0
PROBE_SLACK_S = 1.0
MAX_LOOP_LAG_S = 0.05
CLIENT_TIMEOUT_S = 15.0  # past the 10 s target, so a slow answer shows its time


@dataclass(frozen=True)
class Lag:
    """The loop-lag histogram's cumulative buckets and the max gauge, as scraped."""

    max_s: float
    buckets: dict[float, float]

    def since(self, before: Lag) -> tuple[float, bool]:
        """The worst lag between two scrapes: exact if the max rose, else the bound of the highest bucket that
        gained observations; (seconds, exact)."""
        if self.max_s > before.max_s:
            return self.max_s, True
        gained = {le: count - before.buckets.get(le, 0.0) for le, count in self.buckets.items()}
        total = gained.get(float("inf"), 0.0)
        return min((le for le, n in gained.items() if n >= total), default=0.0), False


def scrape_lag(server: Server) -> Lag | None:
    try:
        text = httpx.get(f"{server.base}/metrics", timeout=15).text
    except httpx.HTTPError:
        return None
    max_s, buckets = None, {}
    for line in text.splitlines():
        if line.startswith("cobali:event_loop_lag_max_seconds "):
            max_s = float(line.split()[-1])
        elif line.startswith('cobali:event_loop_lag_seconds_bucket{le="'):
            le, count = line.removeprefix('cobali:event_loop_lag_seconds_bucket{le="').split('"} ')
            buckets[float(le)] = float(count)
    return Lag(max_s, buckets) if max_s is not None else None


@dataclass
class Row:
    case: str
    kind: str
    status: str
    seconds: float
    probe_s: float  # the worst latency of the probes beside the case (0: none ran)
    lag: str  # seconds; "<=" a bucket's bound when the max did not rise; "n/a" when it could not be read
    alive: bool
    health: str
    failures: list[str] = field(default_factory=list)
    provoked: bool = True
    probe_failed: str = ""  # the first answer other than a 200 a probe beside the case got
    restarted: bool = False  # the server did not recover from the case, and a fresh one took the next

    @property
    def verdict(self) -> str:
        if self.failures:
            return "FAIL: " + "; ".join(self.failures) + (" (server restarted)" if self.restarted else "")
        return "ok" if self.provoked else "n/a (not provoked)"


def expected(expect: str, status: str) -> bool:
    code = int(status) if status.isdigit() else 0
    if expect == BOUNDED:
        return code == 200 or 400 <= code < 500
    if expect == "4xx":
        return 400 <= code < 500
    return status == expect


def send(server: Server, case: Case) -> Outcome:
    headers = {"content-type": "application/json", **(AUTH if case.auth else {})}
    start = time.monotonic()
    try:
        if case.body is None:
            response = httpx.get(f"{server.base}{case.path}", headers=headers, timeout=CLIENT_TIMEOUT_S)
        else:
            response = httpx.post(f"{server.base}{case.path}", content=case.body, headers=headers,
                                  timeout=CLIENT_TIMEOUT_S)
        status = str(response.status_code)
    except httpx.HTTPError as err:
        status = type(err).__name__
    return Outcome(status, time.monotonic() - start, expected(case.expect, status))


def settle(server: Server, wait_s: float = 20.0) -> None:
    """Wait for the last case's own work to end, so each case is measured alone."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if not ours_running(server):
                return
        except (httpx.HTTPError, ValueError):
            return
        time.sleep(0.25)


def run_case(server: Server, probe: Probe, baseline_s: float, case: Case) -> Row:
    """One case: sent beside the probe, then checked against every target. A server that failed one is given
    15 s to answer normally again, or is replaced by a fresh one, so the next case is measured on its own."""
    settle(server)
    before = scrape_lag(server)
    t0 = time.monotonic()
    outcome = SPECIAL[case.special](server, case) if case.special else send(server, case)
    t1 = time.monotonic()
    health = server.health_status() if server.alive() else "dead"
    if health != "200" and server.proc is not None:  # a dying process may still be tearing down: give it a moment
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(2)
    alive = server.alive()
    worst, probe_failed = probe.worst(t0, t1)
    after = scrape_lag(server) if alive else None
    lag_s, lag = None, "n/a"
    if before is not None and after is not None:
        lag_s, exact = after.since(before)
        lag = f"{lag_s:.3f}" if exact else f"<={lag_s:g}"
    row = Row(case.name, case.kind, outcome.status, outcome.seconds, worst, lag, alive, health,
              provoked=outcome.ok is not None, probe_failed=probe_failed)
    row.failures = _failures(case, outcome, row, baseline_s, lag_s, server)
    if row.failures:
        row.restarted = server.ensure(answer_within_s=baseline_s + PROBE_SLACK_S + 1.0)
    return row


def _failures(case: Case, outcome: Outcome, row: Row, baseline_s: float, lag_s: float | None,
              server: Server) -> list[str]:
    failures = []
    if outcome.ok is False:
        failures.append(f"expected {case.expect}")
    if outcome.seconds > ANSWER_WITHIN_S and not case.special:
        failures.append(f"over {ANSWER_WITHIN_S:g} s")
    if row.probe_failed:
        failures.append(f"probe got {row.probe_failed}")
    elif row.probe_s > baseline_s + PROBE_SLACK_S:
        failures.append("probe stalled")
    if not row.alive:
        failures.append(f"process died (exit {server.proc.returncode if server.proc else '?'})")
    elif row.health != "200":
        failures.append(f"/health {row.health}")
    if lag_s is not None and lag_s > MAX_LOOP_LAG_S:
        failures.append("loop lag")
    return failures


def table(rows: list[Row], baseline_s: float, title: str) -> str:
    head = (f"{'case':44} {'class':15} {'status':50} {'s':>6} {'probe s':>8} {'lag s':>8} alive  verdict")
    lines = [title, f"probe baseline (median of 6 normal 2-token requests): {baseline_s:.3f} s; targets: answered "
             f"<= {ANSWER_WITHIN_S:g} s, probe <= baseline + {PROBE_SLACK_S:g} s, alive, /health 200, loop lag "
             f"<= {MAX_LOOP_LAG_S * 1e3:g} ms. probe s: '!' = a probe got no 200 (error, or 20 s timeout); '-' = "
             "none ran beside it", "", head, "-" * len(head)]
    for r in rows:
        probe = "-" if r.probe_s == 0 else f"{r.probe_s:.2f}{'!' if r.probe_failed else ''}"
        lines.append(f"{r.case[:44]:44} {r.kind[:15]:15} {r.status[:50]:50} {r.seconds:6.2f} {probe:>8} {r.lag:>8} "
                     f"{'yes' if r.alive else 'NO':5}  {r.verdict}")
    failed = sum(bool(r.failures) for r in rows)
    lines += ["", f"{len(rows) - failed} of {len(rows)} cases held ({failed} failed, "
              f"{sum(not r.provoked for r in rows)} not provoked)"]
    return "\n".join(lines)
