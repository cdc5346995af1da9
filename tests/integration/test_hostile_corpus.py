"""Issue 36's hostile corpus and fuzzer against a real `cobali serve` on the embedded model (tests/hostile/).

Each case (corpus.py's, anthropic.py's, then fuzz.py's) is sent while a normal 2-token request runs beside it
every 0.5 s; the table (case, status, seconds, worst probe latency and its bound, longest tick, loop-lag max,
alive, verdict) goes to results/hostile_corpus.txt (COBALI_HOSTILE_TABLE names another file under results/) and
to stdout. The slow test first measures the reference tick (harness.measure_reference_tick) that bounds every
tick after it. The corpus test is slow (`.ci/run` runs it, ~3 min); the two
regression tests beside it run in `make test`:
- a `grammar` of 100k nested parentheses killed the process (llama.cpp's GBNF parser recursed per group);
- a 200-byte schema whose enum value is checked against its own backtracking pattern held everyone for 9 s.

COBALI_HOSTILE_SOURCE=/path/to/a/worktree runs the server from other sources (a "before" table of an older
commit; its /metrics needs cobali/http/loop_lag.py for the lag column, and without the tick metric of
cobali/http/prometheus.py the probe is held to its usual time + 1 s and ticks are not checked).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.hostile.anthropic import anthropic_cases
from tests.hostile.corpus import BOUNDED, Case, backtracking_body, completion, corpus, nested_parens_grammar
from tests.hostile.fuzz import fuzz_cases
from tests.hostile.harness import ANSWER_WITHIN_S, Row, Targets, expected, measure_reference_tick, run_case, table
from tests.hostile.server import ROOT, Probe, Server

BUDGET_S = 330.0  # corpus and fuzzer together (COBALI_HOSTILE_BUDGET_S); cases past it are failures: "not run"
FUZZ_BUDGET_S = 45.0  # of which the fuzzer's bodies get the last 45 s


Hostile = tuple[Server, Probe, Targets]


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    server = Server()
    server.start()
    probe = Probe(server)
    probe.start()
    try:
        yield server, probe, Targets(probe.baseline())
    finally:
        probe.stop()
        print(server.log_tail())  # shown by pytest on failure
        server.close()


def _source() -> str:
    source = os.environ.get("COBALI_HOSTILE_SOURCE") or str(ROOT)
    git = ["git", "-C", source]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
    except OSError:
        return source
    return f"{source} at {commit}{' + uncommitted changes' if dirty else ''}"


def _case(hostile: Hostile, case: Case) -> Row:
    server, probe, targets = hostile
    server.ensure()
    row = run_case(server, probe, targets, case)
    print(table([row], targets, case.name))
    return row


def test_100k_nested_parens_grammar_does_not_kill_the_server(hostile: Hostile) -> None:
    row = _case(hostile, Case("grammar: 100k nested parens", "grammar parser",
                              completion(grammar=nested_parens_grammar(100_000))))
    assert row.alive, row.verdict
    assert row.health == "200", row.verdict
    assert expected(BOUNDED, row.status), row.verdict


def test_backtracking_enum_pattern_does_not_stall_a_concurrent_request(hostile: Hostile) -> None:
    body = backtracking_body(26)
    assert len(body) <= 200
    row = _case(hostile, Case("json_schema: enum vs ^(a|a)*$, 26 chars", "backtracking", body))
    assert not row.probe_failed and row.probe_s <= row.bound_s, row.verdict
    assert row.seconds <= ANSWER_WITHIN_S and expected(BOUNDED, row.status), row.verdict


@pytest.mark.slow
def test_hostile_corpus_and_fuzzer(hostile: Hostile) -> None:
    server, probe, targets = hostile
    targets = dataclasses.replace(targets, reference_tick_s=measure_reference_tick(server))
    start = time.monotonic()
    budget_s = float(os.environ.get("COBALI_HOSTILE_BUDGET_S", BUDGET_S))
    out = ROOT / "results" / os.environ.get("COBALI_HOSTILE_TABLE", "hostile_corpus.txt")
    out.parent.mkdir(exist_ok=True)
    rows: list[Row] = []

    def report() -> str:
        title = (f"hostile corpus + fuzzer (issue 36): server from {_source()}; {len(rows)} cases in "
                 f"{time.monotonic() - start:.0f} s, {server.restarts} server restart(s)")
        text = table(rows, targets, title)
        out.write_text(text + "\n")  # after every case: a run cut short still leaves its table
        return text

    cases = [*((c, budget_s - FUZZ_BUDGET_S) for c in [*corpus(), *anthropic_cases()]),
             *((c, budget_s) for c in fuzz_cases())]
    for case, until in cases:
        if time.monotonic() - start > until:
            rows.append(Row(case.name, case.kind, "not run", 0.0, 0.0, "n/a", server.alive(), "-",
                            [f"not run: the {until:.0f} s budget was spent"]))
            continue
        rows.append(run_case(server, probe, targets, case))
        report()
    text = report()
    print(text)
    assert not [row for row in rows if row.failures], f"\n{text}\n(table in {out})"
