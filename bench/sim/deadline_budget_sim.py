"""Tick budgets side by side on a simulated device, at several Poisson rates (deterministic: virtual time).

    .venv/bin/python bench/sim/deadline_budget_sim.py [--rates 0.05 0.1 0.2 inf] [--seeds N] \\
        [--budget "--itl-target-ms 250" --budget "--tpot-slo-ms 100"] [-- simulate flags...]

Every (rate, budget) pair runs `cobali simulate` with the shared flags after `--` (default: the issue-16
workload on this CPU's bundled profile: 48 prompts of 70-1330 tokens, 16-256 output tokens, 16 slots,
2048 KV cells each, n_batch 512) plus the rate and the budget's flags, and prints one row of latencies.
With --seeds N each pair runs the arrival seeds 0..N-1: the row shows the median over them and, in
brackets, the median over seeds of each metric's ratio to the first budget on the same arrivals (near
saturation one arrival pattern can move a p50 2x, so only paired ratios compare budgets).
"""

from __future__ import annotations

import argparse
import shlex
import statistics

from cobali.faces.cli import build_parser
from cobali.faces.simulate import sim_spec, sim_workload
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


def runs(rate: str, budget: str, shared: list[str], seeds: int) -> list[dict]:
    """One summary per arrival seed (the shared flags' own --seed when seeds is 1)."""
    if seeds == 1:
        return [row(rate, budget, shared)]
    return [row(rate, budget, [*shared, "--seed", str(seed)]) for seed in range(seeds)]


def cells(summaries: list[dict], first: list[dict] | None) -> str:
    """Each column's median, with the median paired ratio to `first` (the first budget's runs) if given."""
    text = ""
    for column in COLUMNS:
        text += f"{statistics.median(s[column] for s in summaries):>12.0f}"
        if first is not None:
            ratio = statistics.median(s[column] / f[column] for s, f in zip(summaries, first, strict=True))
            text += f" ({ratio:.2f})"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["0.05", "0.1", "0.2", "inf"])
    parser.add_argument("--budget", action="append", default=None, help="budget flags, one set per use")
    parser.add_argument("--seeds", type=int, default=1, help="arrival seeds per (rate, budget), from 0")
    parser.add_argument("shared", nargs="*", default=shlex.split(WORKLOAD), help="simulate flags (after --)")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    width = 19 if args.seeds > 1 else 12
    print(f"{'rate':>6}  {'budget':<36}" + "".join(f"{c.removesuffix('_ms'):>{width}}" for c in COLUMNS))
    for rate in args.rates:
        first: list[dict] | None = None
        for budget in args.budget or BUDGETS:
            summaries = runs(rate, budget, args.shared, args.seeds)
            first = first or summaries
            print(f"{rate:>6}  {budget:<36}" + cells(summaries, first if args.seeds > 1 else None))


if __name__ == "__main__":
    main()
