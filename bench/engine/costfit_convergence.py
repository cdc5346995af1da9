"""How fast the engine learns its tick costs on this machine, and how it re-learns them when they change.

    .venv/bin/python bench/engine/costfit_convergence.py --prompts mixed_length [--hog-at-tick 150] [--out DIR]

Runs the workload through the engine under an ITL target with no profile (the serving default), then
replays the engine's ticks through a fresh fit, in the same order: the prediction each tick got before it
was learned is what the engine's own fit predicted. Prints the median and p90 relative error of those
predictions by ranges of ticks, and where the fit became confident. --hog-at-tick N starts one busy
process per core at tick N (another tenant arriving: every tick gets slower) and stops them at the end.
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing
import os
from pathlib import Path

import numpy as np

from cobali.config.flags import add_engine_args, engine_setup, non_negative_int, positive_int
from cobali.engine.costs import OnlineCostFit, TickTerms
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.harness.workloads import load_items

RANGES = ((0, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512), (512, 1024), (1024, 4096))


def _spin() -> None:
    while True:
        pass


def replay(ticks: list[TickRecord]) -> list[dict]:
    fit = OnlineCostFit()
    rows = []
    for i, tick in enumerate(ticks):
        terms = TickTerms.of_plan(tick.plan)
        measured = tick.end - tick.start
        predicted = fit.predict(terms)
        rows.append({"tick": i, "prefill": terms.prefill_tokens, "decode": terms.decode_rows,
                     "decode_kv": terms.decode_kv_tokens, "prefill_kv": terms.prefill_kv_tokens,
                     "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                     "error": abs(predicted - measured) / measured, "confident": fit.confident})
        fit.observe(terms, measured)
    print(f"final fit: {fit.describe()}")
    return rows


def report(rows: list[dict], hog_at: int | None) -> None:
    print(f"{'ticks':>12}{'median err':>12}{'p90 err':>10}{'confident':>11}")
    for lo, hi in RANGES:
        part = rows[lo:hi]
        if not part:
            break
        errors = np.array([r["error"] for r in part])
        share = np.mean([r["confident"] for r in part])
        print(f"{f'{lo + 1}-{lo + len(part)}':>12}{np.median(errors):>12.1%}{np.quantile(errors, 0.9):>10.1%}"
              f"{share:>11.0%}")
    first = next((r["tick"] for r in rows if r["confident"]), None)
    print(f"confident from tick {first}" if first is not None else "never confident")
    if hog_at is not None:
        after = [r for r in rows if r["tick"] >= hog_at]
        regained = next((r["tick"] for r in after if r["confident"] and r["tick"] > hog_at + 1), None)
        lost = next((r["tick"] for r in after if not r["confident"]), None)
        print(f"busy processes from tick {hog_at}: confidence lost at tick {lost}, regained at tick {regained}")
        for lo in (0, 8, 16, 32, 64):
            part = after[lo:lo + 16]
            if part:
                print(f"  ticks {hog_at + lo + 1}-{hog_at + lo + len(part)} after: median error "
                      f"{np.median([r['error'] for r in part]):.1%}")


def plot(rows: list[dict], path: Path, hog_at: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ticks = [r["tick"] for r in rows]
    top.plot(ticks, [r["measured_ms"] for r in rows], ".", ms=3, label="measured")
    top.plot(ticks, [r["predicted_ms"] for r in rows], ".", ms=3, label="predicted before the tick")
    top.set_ylabel("tick ms")
    top.legend()
    bottom.semilogy(ticks, [max(r["error"], 1e-4) for r in rows], ".", ms=3)
    bottom.set_ylabel("relative error")
    bottom.set_xlabel("tick")
    for ax in (top, bottom):
        if hog_at is not None:
            ax.axvline(hog_at, color="red", lw=1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.set_defaults(itl_target_ms=250.0)  # the convergence studied is the ITL target's
    parser.add_argument("--prompts", default="mixed_length")
    parser.add_argument("--num-prompts", type=positive_int, default=None)
    parser.add_argument("--max-new", type=positive_int, default=64)
    parser.add_argument("--hog-at-tick", type=non_negative_int, default=None)
    parser.add_argument("--out", default=None, help="write ticks.csv and convergence.png here")
    args = parser.parse_args()
    engine = engine_setup(args).build_engine()
    hogs: list[multiprocessing.Process] = []

    def on_tick(record: TickRecord) -> None:
        if args.hog_at_tick is not None and len(engine.ticks) == args.hog_at_tick and not hogs:
            hogs.extend(multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1))
            for hog in hogs:
                hog.start()

    engine.on_tick = on_tick
    for item in load_items(args.prompts, args.num_prompts):
        engine.add_request(item.prompt, SamplingParams(max_tokens=item.max_tokens or args.max_new, ignore_eos=True))
    try:
        list(LLM(engine).run())
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"{len(engine.ticks)} ticks on {engine.backend_info.description}, ITL target {args.itl_target_ms:g} ms")
    rows = replay(engine.ticks)
    report(rows, args.hog_at_tick)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "ticks.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, out / "convergence.png", args.hog_at_tick)
        print(f"wrote {out / 'ticks.csv'} and {out / 'convergence.png'}")


if __name__ == "__main__":
    main()
