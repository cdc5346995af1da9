"""The simulator against a real `cobali bench` run, tick by tick.

    .venv/bin/python bench/sim/sim_vs_real.py results/val/mixed/ticks_cont.csv \\
        --prompts workloads/mixed_length.json --max-slots 16 --no-prefix-cache [--itl-target-ms 250] [--profile P]

Everything after the ticks file is `cobali simulate`'s flags, as the real run was given them. The prompts are
tokenized by the embedded model, as the real run tokenized them, so the simulated scheduler sees the real
token counts. Each simulated tick is then set beside the real tick of the same index: do they carry the same
decode rows and prefill tokens, and how does the profile's predicted time compare with the measured decode
call, summed by kind of tick.
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from dataclasses import replace

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.faces.bench import file_items
from cobali.faces.cli import build_parser
from cobali.faces.simulate import sim_spec
from cobali.harness.workloads import arrival_offsets
from cobali.sim.backend import SimBackend
from cobali.sim.cluster import SimItem, simulate


def kind(decode_rows: int, prefill_tokens: int) -> str:
    return "mixed" if decode_rows and prefill_tokens else "decode only" if decode_rows else "prefill only"


def simulated_ticks(argv: list[str]) -> list[tuple[int, int, float]]:
    """(decode rows, prefill tokens, predicted s) of every tick of the simulated run."""
    args = build_parser().parse_args(["simulate", *argv])
    spec = sim_spec(args)
    spec = replace(spec, replicas=1, config=replace(spec.config, record_ticks=True))
    items = file_items(args)
    if items is None:
        raise SystemExit("give the real run's --prompts file")
    model = LlamaCppBackend(LlamaCppConfig(embedded_model_path(), n_seq_max=1))
    n_vocab = SimBackend(spec.costs).n_vocab
    work = []
    for item in items:
        ids = model.tokenize(item.prompt) if isinstance(item.prompt, str) else item.prompt
        # The model's ids folded into the simulated vocabulary; 0 is the fake's end of generation.
        work.append(SimItem([1 + token % (n_vocab - 1) for token in ids], item.max_tokens or args.max_new))
    result = simulate(work, arrival_offsets(len(work), args.request_rate, args.burstiness, args.seed).tolist(), spec)
    return [(t.plan.n_decode, t.plan.n_prefill_tokens, t.decode_s) for t in result.replicas[0].engine.ticks]


def main() -> int:
    if len(sys.argv) < 3 or not sys.argv[1].endswith(".csv"):
        raise SystemExit(__doc__)
    real_path, argv = sys.argv[1], sys.argv[2:]
    try:
        with open(real_path) as f:
            real = [(int(r["decode_rows"]), int(r["prefill_rows"]), float(r["decode_ms"]) / 1e3)
                    for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError) as err:
        raise SystemExit(f"{real_path}: not a ticks CSV written by `cobali bench --out` ({err!r})") from None
    sim = simulated_ticks(argv)
    same = sum(s[:2] == r[:2] for s, r in zip(sim, real, strict=False))
    print(f"ticks: simulated {len(sim)}, real {len(real)}; same decode rows and prefill tokens: {same}")
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for (decode_rows, prefill_tokens, predicted), (*_, measured) in zip(sim, real, strict=False):
        entry = sums[kind(decode_rows, prefill_tokens)]
        entry[0] += 1
        entry[1] += measured
        entry[2] += predicted
    print(f"{'tick kind':<14}{'ticks':>7}{'real s':>9}{'predicted s':>13}{'real/predicted':>16}")
    for name, (count, measured, predicted) in sorted(sums.items()):
        print(f"{name:<14}{count:>7}{measured:>9.1f}{predicted:>13.1f}{measured / predicted:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
