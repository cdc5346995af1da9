"""Replicas sharing one host's CPUs in the simulator (cobali/sim/host.py)."""

from __future__ import annotations

import pytest

from cobali.engine.costs import CostProfile
from cobali.engine.engine_config import EngineConfig
from cobali.faces.cli import main
from cobali.sim.cluster import SimItem, SimSpec, simulate
from cobali.sim.host import SharedHost

# 10 ms a prompt token and nothing else: a 10-token chunk is a 0.1 s tick
COSTS = CostProfile(t0_s=0.0, prefill_s_per_token=0.01, decode_s_per_row=0.01, decode_s_per_kv_token=0.0)
CONFIG = EngineConfig(max_slots=2, n_batch=10, record_ticks=False)


def ttfts_s(items: list[SimItem], arrivals: list[float], host: SharedHost | None) -> list[float]:
    result = simulate(items, arrivals, SimSpec(COSTS, CONFIG, replicas=2, host=host))
    times = [f.timing.ttft_ms for f in result.finished if f is not None]
    assert len(times) == len(items) and result.placements == [0, 1][: len(items)]
    return [t / 1e3 for t in times if t is not None]


def test_a_tick_slows_while_the_replicas_and_the_background_outgrow_the_cores() -> None:
    host = SharedHost(cores=2, background=1.0)
    assert host.slowdown(1) == 1.0 and host.slowdown(2) == 2.0 and SharedHost(4, 1, threads=2).slowdown(2) == 4 / 3
    assert SharedHost(2, 1.0, pace=1.5).slowdown(1) == 1.5 and SharedHost(2, 1.0, pace=1.5).slowdown(2) == 3.0
    one = [SimItem(list(range(1, 11)), 1)]
    assert ttfts_s(one, [0.0], host) == pytest.approx([0.1])  # alone, one core is free for the background
    two = [SimItem(list(range(1, 11)), 1), SimItem(list(range(11, 21)), 1)]
    assert ttfts_s(two, [0.0, 0.0], None) == pytest.approx([0.1, 0.1])
    assert ttfts_s(two, [0.0, 0.0], host) == pytest.approx([0.2, 0.2])
    assert ttfts_s(one, [0.0], SharedHost(cores=2, background=1.0, pace=1.5)) == pytest.approx([0.15])


def test_each_tick_sees_the_replicas_computing_at_its_start() -> None:
    # Replica 0 prefills 50 tokens in five ticks; replica 1's request comes at 0.25, during the third, and computes
    # until 0.45. The third keeps its pace; the fourth, which starts at 0.3, takes twice as long; the fifth does not.
    items = [SimItem(list(range(1, 51)), 1), SimItem(list(range(51, 61)), 1)]
    assert ttfts_s(items, [0.0, 0.25], None) == pytest.approx([0.5, 0.1])
    assert ttfts_s(items, [0.0, 0.25], SharedHost(cores=2, background=1.0)) == pytest.approx([0.6, 0.2])


def test_a_host_needs_cores_beyond_its_background(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="--host-background 2 must be at least 0 and below --host-cores 2"):
        SharedHost(cores=2, background=2)
    argv = ["simulate", "--profile", "cpu-2core-smollm2", "--random-input-len", "64", "--random-output-len", "4",
            "--num-prompts", "8", "--request-rate", "1", "--max-slots", "4", "--replicas", "2", "--threads", "1"]
    with pytest.raises(SystemExit):
        main([*argv, "--host-background", "0.3"])
    assert "--host-background 0.3 needs --host-cores" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--host-pace", "1.1"])
    assert "--host-pace 1.1 needs --host-cores" in capsys.readouterr().err
    assert main([*argv, "--host-cores", "2", "--host-background", "0.3", "--host-pace", "1.1"]) == 0
