"""`cobali bench serve --sweep`: goodput as vLLM defines it, the capacity search, and the command end to end
against mocked servers."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import httpx
import pytest

from cobali.faces import bench_sweep as sweep_cli
from cobali.faces import cli
from cobali.harness.serve_client import ClientRecord, ServeResult, run_serve
from cobali.harness.sweep import (
    CapacitySearch,
    combine_repeats,
    goodput,
    meets,
    parse_limits,
    parse_rates,
    slo_metrics,
)
from tests.unit.harness.test_bench_serve import FakeServer


def record(ttft_s: float, end_s: float, n_tokens: int, error: str | None = None) -> ClientRecord:
    chunks = [ttft_s + i * (end_s - ttft_s) / max(1, n_tokens - 1) for i in range(n_tokens)]
    return ClientRecord(0, start=0.0, chunk_times=chunks, end=end_s, output_tokens=n_tokens, error=error)


def test_limits_and_rates_parse_or_name_the_bad_value() -> None:
    assert parse_limits("ttft:500,tpot:50", ("ttft", "tpot"), "--goodput") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_limits("ttft:500 e2el:9000", ("ttft", "e2el"), "--goodput") == {"ttft": 500.0, "e2el": 9000.0}
    for bad, message in (("ttft=5", "'ttft=5'"), ("itl:5", "'itl:5'"), ("ttft:x", "'x'"), ("ttft:0", "> 0"),
                         ("", "at least one")):
        with pytest.raises(ValueError, match=message):
            parse_limits(bad, ("ttft", "tpot", "e2el"), "--goodput")
    assert parse_rates("0.5,0.2,inf") == (0.2, 0.5, float("inf"))
    for bad in ("", "a,1", "0,1", "-1"):
        with pytest.raises(ValueError, match="--sweep"):
            parse_rates(bad)


def test_goodput_counts_requests_within_every_limit_per_second_as_vllm_does() -> None:
    # TPOT is (E2EL - TTFT) / (tokens - 1): 0.1 s + 9 gaps of 0.1 s -> 100 ms; a one-token output has TPOT 0.
    records = [record(0.1, 1.0, 10), record(0.1, 1.9, 10), record(2.0, 2.0, 1), record(0.1, 1.0, 10, "HTTP 500")]
    assert slo_metrics(records[0]) == pytest.approx({"ttft": 100.0, "tpot": 100.0, "e2el": 1000.0})
    assert slo_metrics(records[1])["tpot"] == pytest.approx(200.0)
    assert slo_metrics(records[2]) == pytest.approx({"ttft": 2000.0, "tpot": 0.0, "e2el": 2000.0})
    result = ServeResult(records, wall_s=2.0, user_cpu_s=0.0)
    assert goodput(result, {"tpot": 100.0}) == pytest.approx(2 / 2.0)  # the failed request never counts
    assert goodput(result, {"ttft": 1000.0, "tpot": 150.0}) == pytest.approx(1 / 2.0)
    assert goodput(result, {"e2el": 5000.0}) == pytest.approx(3 / 2.0)


def search(held: Callable[[float], bool], rates: tuple[float, ...], steps: int) -> CapacitySearch:
    capacity = CapacitySearch()
    for rate in rates:
        capacity.record(rate, held(rate))
    for _ in range(steps):
        mid = capacity.midpoint()
        if mid is None:
            break
        capacity.record(mid, held(mid))
    return capacity


def test_capacity_is_the_highest_rate_that_holds_after_bisection() -> None:
    ran: list[float] = []

    def held(rate: float) -> bool:
        ran.append(rate)
        return rate <= 0.65

    capacity = search(held, (0.2, 0.5, 1.0), steps=2).capacity()
    assert ran == [0.2, 0.5, 1.0, pytest.approx(0.5 ** 0.5), pytest.approx((0.5 * 0.5 ** 0.5) ** 0.5)]
    assert capacity.rate == pytest.approx((0.5 * 0.5 ** 0.5) ** 0.5) and capacity.bounded
    assert search(lambda r: True, (0.2, 0.5), steps=3).capacity().describe() == ">= 0.5 req/s (no rate tried failed)"
    assert search(lambda r: False, (0.2, 0.5), steps=3).capacity().rate is None
    # A pass above a failure moves the bracket up: the failure below it no longer bounds the search.
    assert search(lambda r: r != 0.5, (0.2, 0.5, 1.0), steps=0).bounds() == (1.0, None)
    assert search(lambda r: r < 1.0, (0.5, math.inf), steps=2).capacity().tried == ((0.5, True), (math.inf, False))


def test_repeats_combine_into_medians_with_their_noise() -> None:
    runs = [{"rate": 0.5, "ttft_p99_ms": v, "failed": f, "tpot_p99_ms": None} for v, f in ((90.0, 0), (100.0, 1),
                                                                                      (130.0, 0))]
    row = combine_repeats(runs)
    assert (row["rate"], row["ttft_p99_ms"], row["failed"], row["repeats"]) == (0.5, 100.0, 1, 3)
    assert row["noise"] == {"ttft_p99_ms": pytest.approx(0.2)} and row["tpot_p99_ms"] is None
    assert combine_repeats(runs[:1]) == runs[0]


def test_meets_reads_the_p99s_and_fails_runs_with_errors() -> None:
    slo = {"ttft_p99": 5000.0, "tpot_p99": 150.0}
    assert meets({"ttft_p99_ms": 4000.0, "tpot_p99_ms": 150.0, "failed": 0}, slo)
    assert not meets({"ttft_p99_ms": 5001.0, "tpot_p99_ms": 10.0, "failed": 0}, slo)
    assert not meets({"ttft_p99_ms": 1.0, "tpot_p99_ms": None, "failed": 0}, slo)
    assert not meets({"ttft_p99_ms": 1.0, "tpot_p99_ms": 1.0, "failed": 1}, slo)


def test_sweep_runs_the_servers_in_turn_at_every_rate_and_plots_each_metric(tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\ntwo\nthree\nfour\n")
    fast, slow = FakeServer(["a", "b", "c"]), FakeServer(["a", "b", "c"], delay=0.05)

    def route(request: httpx.Request):
        return (fast if request.url.port == 8001 else slow)(request)

    seeds: dict[str, list[int]] = {"fast": [], "slow": []}

    def patched(items, options):
        seeds["fast" if options.url.endswith(":8001") else "slow"].append(options.seed)
        return run_serve(items, options, transport=httpx.MockTransport(route), progress=False)

    out = io.StringIO()
    with mock.patch.object(sweep_cli, "run_serve", patched), contextlib.redirect_stdout(out):
        code = cli.main(["bench", "serve", "--url", "fast=http://bench.test:8001", "--url",
                         "slow=http://bench.test:8002", "--prompts", str(prompts), "--sweep", "400,200",
                         "--goodput", "tpot:15", "--slo", "ttft_p99:5000,tpot_p99:15", "--capacity-steps", "1",
                         "--repeat", "2", "--seed", "5",
                         "--out", str(tmp_path / "r")])
    assert code == 0
    sweep = json.loads((tmp_path / "r" / "sweep.json").read_text())
    fast_rows, slow_rows = (sweep["servers"][name]["rows"] for name in ("fast", "slow"))
    assert [r["rate"] for r in fast_rows] == [200.0, 400.0] and len(slow_rows) == 2
    assert all(r["requests"] == 4 and r["failed"] == 0 and r["repeats"] == 2 for r in fast_rows + slow_rows)
    assert all("ttft_p99_ms" in r["noise"] for r in slow_rows)
    # Six tokens each (the fake's usage): the slow server's 2 x 50 ms over 5 tokens miss a 15 ms TPOT.
    assert [r["goodput_req_s"] > 0 for r in fast_rows + slow_rows] == [True, True, False, False]
    capacities = {name: server["capacity"]["rate"] for name, server in sweep["servers"].items()}
    assert capacities == {"fast": 400.0, "slow": None}
    assert len(fast.bodies) == len(slow.bodies) == 16  # two runs at both rates; no bisection without a bound
    # Every run's prompts are its own, so no server can answer one run from another's cached prompts.
    assert len({body["prompt"] for body in fast.bodies + slow.bodies}) == 32
    # The servers take turns within every repeat at every rate, so the machine's drift falls on both alike.
    def runs(server: FakeServer) -> list[int]:
        return sorted({int(re.match(r"\[run (\d+)\]", body["prompt"]).group(1)) for body in server.bodies})
    assert runs(fast) == [0, 2, 4, 6] and runs(slow) == [1, 3, 5, 7]
    # Each repeat its own arrival pattern, and within a repeat the same one for every server.
    assert seeds["fast"] == seeds["slow"] == [5, 6, 5, 6]
    assert all([run["seed"] for run in row["runs"]] == [5, 6] for row in fast_rows + slow_rows)
    for name in ("ttft_p99", "tpot_p50", "itl_p99", "goodput_req_s", "output_tok_s"):
        assert (tmp_path / "r" / f"sweep_{name}.png").read_bytes().startswith(b"\x89PNG")
    assert "capacity >= 400 req/s" in out.getvalue()


@pytest.mark.parametrize(("flags", "message"), [
    (["--sweep", "fast"], "--sweep"), (["--sweep", "1", "--goodput", "ttft"], "--goodput"),
    (["--sweep", "1", "--slo", "ttft_p50:1"], "--slo"), (["--url", "x=h:1"], "--url"),
    (["--sweep", "1", "--repeat", "0"], "--repeat"),
])
def test_bad_sweep_flags_are_named(tmp_path: Path, capsys: pytest.CaptureFixture, flags: list[str],
                                   message: str) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("one\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "serve", "--url", "http://bench.test:1", "--prompts", str(prompts), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
