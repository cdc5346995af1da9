"""What gaps between the running slots cost in a real run, from `cobali bench`'s tick records.

    .venv/bin/python bench/engine/slot_gaps.py results/run-a/ticks_cont.csv results/run-b/ticks_cont.csv ...

For each file, over its decode-only ticks: how many ran with their slots in more than one run of consecutive
seq_ids (`slot_runs`: with per-sequence KV streams llama.cpp runs one forward pass per run), and a least-squares
fit of decode ms = fixed + per row x rows + per 1k KV tokens x decode_kv_tokens / 1000 + per extra run x
(slot_runs - 1). Runs without compaction (`--no-compact-slots`) price a gap in place; runs with it should have
none, and their other terms should match.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

TERMS = ("fixed", "per row", "per 1k KV", "per extra run")


def decode_only(path: Path) -> np.ndarray:
    """Rows of (rows, KV tokens / 1000, extra runs, decode ms), one per decode-only tick."""
    with path.open() as f:
        ticks = [t for t in csv.DictReader(f) if t["prefill_rows"] == "0" and t["decode_rows"] != "0"]
    if ticks and not {"slot_runs", "decode_kv_tokens"} <= ticks[0].keys():
        raise SystemExit(f"{path}: no slot_runs or decode_kv_tokens column (written before they existed)")
    return np.array([(int(t["decode_rows"]), int(t["decode_kv_tokens"]) / 1000, int(t["slot_runs"]) - 1,
                      float(t["decode_ms"])) for t in ticks])


def fit(ticks: np.ndarray) -> dict[str, float]:
    """The terms' ms; a term no tick varies (no gap at all) is left out of the fit and reported as 0."""
    x = np.column_stack([np.ones(len(ticks)), ticks[:, :3]])
    used = [i for i in range(x.shape[1]) if i == 0 or np.ptp(x[:, i]) > 0]
    coef, *_ = np.linalg.lstsq(x[:, used], ticks[:, 3], rcond=None)
    values = dict.fromkeys(TERMS, 0.0)
    values.update({TERMS[i]: float(c) for i, c in zip(used, coef, strict=True)})
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ticks", nargs="+", type=Path, help="ticks_<config>.csv files of `cobali bench --out`")
    args = parser.parse_args()
    print(f"{'file':<48}{'ticks':>7}{'gapped':>8}{'total s':>9}" + "".join(f"{t:>15}" for t in TERMS))
    for path in args.ticks:
        if not path.is_file():
            parser.error(f"no such file: {path}")
        ticks = decode_only(path)
        if len(ticks) < len(TERMS):
            print(f"{path!s:<48}{len(ticks):>7}  too few decode-only ticks to fit")
            continue
        terms = fit(ticks)
        gapped = int((ticks[:, 2] > 0).sum())
        print(f"{path!s:<48}{len(ticks):>7}{gapped:>8}{ticks[:, 3].sum() / 1e3:>9.1f}"
              + "".join(f"{terms[t]:>15.2f}" for t in TERMS))


if __name__ == "__main__":
    main()
