"""Issue 36's hostile corpus and fuzzer against a real `cobali serve` on the embedded model (tests/hostile/).

Each case is sent while a normal 2-token request runs beside it every 0.5 s; the table (case, status, seconds,
worst probe latency, loop-lag max, alive, verdict) goes to results/hostile_corpus.txt (COBALI_HOSTILE_TABLE
names another file under results/) and to stdout. The corpus test is slow (`.ci/run` runs it, ~3 min); the two
regression tests beside it run in `make test`:
- a `grammar` of 100k nested parentheses killed the process (llama.cpp's GBNF parser recursed per group);
- a 200-byte schema whose enum value is checked against its own backtracking pattern held everyone for 9 s.

COBALI_HOSTILE_SOURCE=/path/to/a/worktree runs the server from other sources (a "before" table of an older
commit; its /metrics needs cobali/http/loop_lag.py for the lag column).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.hostile.corpus import BOUNDED, Case, backtracking_body, completion, corpus, nested_parens_grammar
from tests.hostile.fuzz import fuzz_cases
from tests.hostile.harness import ANSWER_WITHIN_S, PROBE_SLACK_S, Row, expected, run_case, table
from tests.hostile.server import ROOT, Probe, Server

BUDGET_S = 330.0  # corpus and fuzzer together (COBALI_HOSTILE_BUDGET_S); cases past it are failures: "not run"
FUZZ_BUDGET_S = 45.0  # of which the fuzzer's bodies get the last 45 s


@pytest.fixture(scope="module")
def hostile() -> Iterator[tuple[Server, Probe, float]]:
    server = Server()
    server.start()
    probe = Probe(server)
    probe.start()
    try:
        yield server, probe, probe.baseline()
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


def _case(hostile: tuple[Server, Probe, float], case: Case) -> Row:
    server, probe, baseline = hostile
    server.ensure()
    row = run_case(server, probe, baseline, case)
    print(table([row], baseline, case.name))
    return row


def test_100k_nested_parens_grammar_does_not_kill_the_server(hostile: tuple[Server, Probe, float]) -> None:
    row = _case(hostile, Case("grammar: 100k nested parens", "grammar parser",
                              completion(grammar=nested_parens_grammar(100_000))))
    assert row.alive, row.verdict
    assert row.health == "200", row.verdict
    assert expected(BOUNDED, row.status), row.verdict


def test_backtracking_enum_pattern_does_not_stall_a_concurrent_request(
        hostile: tuple[Server, Probe, float]) -> None:
    body = backtracking_body(26)
    assert len(body) <= 200
    row = _case(hostile, Case("json_schema: enum vs ^(a|a)*$, 26 chars", "backtracking", body))
    assert not row.probe_failed and row.probe_s <= hostile[2] + PROBE_SLACK_S, row.verdict
    assert row.seconds <= ANSWER_WITHIN_S and expected(BOUNDED, row.status), row.verdict


@pytest.mark.slow
def test_hostile_corpus_and_fuzzer(hostile: tuple[Server, Probe, float]) -> None:
    server, probe, baseline = hostile
    start = time.monotonic()
    budget_s = float(os.environ.get("COBALI_HOSTILE_BUDGET_S", BUDGET_S))
    out = ROOT / "results" / os.environ.get("COBALI_HOSTILE_TABLE", "hostile_corpus.txt")
    out.parent.mkdir(exist_ok=True)
    rows: list[Row] = []

    def report() -> str:
        title = (f"hostile corpus + fuzzer (issue 36): server from {_source()}; {len(rows)} cases in "
                 f"{time.monotonic() - start:.0f} s, {server.restarts} server restart(s)")
        text = table(rows, baseline, title)
        out.write_text(text + "\n")  # after every case: a run cut short still leaves its table
        return text

    for case, until in [*((c, budget_s - FUZZ_BUDGET_S) for c in corpus()), *((c, budget_s) for c in fuzz_cases())]:
        if time.monotonic() - start > until:
            rows.append(Row(case.name, case.kind, "not run", 0.0, 0.0, "n/a", server.alive(), "-",
                            [f"not run: the {until:.0f} s budget was spent"]))
            continue
        rows.append(run_case(server, probe, baseline, case))
        report()
    text = report()
    print(text)
    assert not [row for row in rows if row.failures], f"\n{text}\n(table in {out})"
