"""Tick budgets side by side on a simulated device, at several Poisson rates (deterministic: virtual time).

    .venv/bin/python bench/deadline_budget_sim.py [--rates 0.05 0.1 0.2 inf] \\
        [--budget "--itl-target-ms 250" --budget "--tpot-slo-ms 100"] [-- simulate flags...]

Every (rate, budget) pair runs `cobali simulate` with the shared flags after `--` (default: the issue-16
workload on this CPU's bundled profile: 48 prompts of 70-1330 tokens, 16-256 output tokens, 16 slots,
2048 KV cells each, n_batch 512) plus the rate and the budget's flags, and prints one row of latencies.
"""

from __future__ import annotations

import argparse
import shlex

from cobali.cli import build_parser
from cobali.sim.cli import sim_spec, sim_workload
from cobali.sim.cluster import simulate

WORKLOAD = ("--profile cpu-2core-smollm2 --num-prompts 48 --random-input-len 700 --random-output-len 136 "
            "--random-range-ratio 0.9 --max-slots 16 --n-batch 512 --ctx 32768")
BUDGETS = ("--itl-target-ms 250", "--tpot-slo-ms 100", "--tpot-slo-ms 100 --itl-max-ms 1000")
COLUMNS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "wall_s")


def row(rate: str, budget: str, shared: list[str]) -> dict:
    args = build_parser().parse_args(["simulate", *shared, "--request-rate", rate, *shlex.split(budget)])
    spec = sim_spec(args)
    items, arrivals = sim_workload(args, spec)
    return simulate(items, arrivals.tolist(), spec).summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["0.05", "0.1", "0.2", "inf"])
    parser.add_argument("--budget", action="append", default=None, help="budget flags, one set per use")
    parser.add_argument("shared", nargs="*", default=shlex.split(WORKLOAD), help="simulate flags (after --)")
    args = parser.parse_args()
    print(f"{'rate':>6}  {'budget':<36}" + "".join(f"{c.removesuffix('_ms'):>12}" for c in COLUMNS))
    for rate in args.rates:
        for budget in args.budget or BUDGETS:
            summary = row(rate, budget, args.shared)
            print(f"{rate:>6}  {budget:<36}" + "".join(f"{summary[c]:>12.0f}" for c in COLUMNS))


if __name__ == "__main__":
    main()
