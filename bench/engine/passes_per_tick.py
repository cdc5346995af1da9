"""Forward passes per tick, graph reuses and logits rows copied, on a decode-heavy run through the engine:
llama.cpp's own counts (LlamaCppConfig.count_decodes) beside what cobali/engine/ubatches.py predicts from
each tick's plan (issue 37's CPU proxies).

    .venv/bin/python bench/engine/passes_per_tick.py                       # prompts_186, 64 new tokens, cont
    .venv/bin/python bench/engine/passes_per_tick.py --sampling host --kv-unified
    .venv/bin/python bench/engine/passes_per_tick.py --num-prompts 24 --max-new 16 --json out.json
    .venv/bin/python bench/engine/passes_per_tick.py --sampling host --show-ticks 8    # and some ticks' passes
    .venv/bin/python bench/engine/passes_per_tick.py --sampling host --two-pass-ticks  # ticks kept to two passes

Every flag of `cobali run` applies (--max-slots, --prefill-chunk-tokens, --model, ...). --sampling both runs
the workload twice: greedy tokens by the host's argmax, then picked in llama.cpp's graph (--backend-sampling).
The plan alone fixes the counts, not the machine's speed (with the fixed budget, the default), so no timings
are reported.
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.config.flags import add_engine_args, backend_config, engine_config, positive_int
from cobali.engine.engine import Engine
from cobali.engine.plan import TickRecord
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.ubatches import SeqRows, logits_rows_copied, plan_rows, split_batch
from cobali.frontend.offline import LLM
from cobali.harness.workloads import load_items


def run(args: argparse.Namespace, device_sampling: bool) -> dict:
    backend = LlamaCppBackend(replace(backend_config(args), backend_sampling=device_sampling, count_decodes=True))
    engine = Engine(backend, engine_config(args))
    prompts = [item.prompt for item in load_items(args.prompts, args.num_prompts)]
    LLM(engine).generate(prompts, SamplingParams(max_tokens=args.max_new, ignore_eos=True))
    counts, ticks = backend.decode_counts, engine.ticks
    per_seq_streams = not backend.options.kv_unified and backend.info.n_seq_max > 1
    n_ubatch = backend.info.n_batch  # cobali's contexts run n_ubatch = n_batch (loading.new_context)
    backend.close()
    assert len(counts) == len(ticks), f"{len(counts)} decodes for {len(ticks)} ticks"
    show_ticks([t for t in ticks if t.plan.n_prefill_tokens][:args.show_ticks], n_ubatch, per_seq_streams)
    rows: list[dict] = []
    for tick, count in zip(ticks, counts, strict=True):
        batch = plan_rows(tick.plan)
        ubatches = split_batch(batch, n_ubatch, per_seq_streams)
        # Every request of this run is greedy and reads no logprobs: with device sampling all are picked there.
        on_device = {r.seq_id for r in batch} if device_sampling else set()
        rows.append({"mixed": tick.plan.n_prefill_tokens > 0, "prefill": tick.plan.n_prefill_tokens,
                     "passes_model": len(ubatches),
                     "passes": count.passes, "reused": count.graphs_reused,
                     "outputs": sum(r.n_outputs for r in batch),
                     "raw_rows_model": logits_rows_copied(ubatches, on_device), "raw_rows": count.raw_logits_rows,
                     "sampled_rows": count.sampled_logits_rows,
                     "unified_model": len(split_batch(batch, n_ubatch, per_seq_streams=False))})
    return summarize(rows)


def show_ticks(ticks: list[TickRecord], n_ubatch: int, per_seq_streams: bool) -> None:
    """Each tick's rows as slot:rows (runs of one-row slots as first-last:1), then its passes."""
    for tick in ticks:
        passes = split_batch(plan_rows(tick.plan), n_ubatch, per_seq_streams)
        print(f"  tick {tick.plan.tick}: {_layout(plan_rows(tick.plan))} -> {len(passes)} passes: "
              + " | ".join(_layout(p.rows) for p in passes))


def _layout(rows: Sequence[SeqRows]) -> str:
    parts: list[list[int]] = []  # [first slot, last slot, rows each]
    for r in rows:
        if parts and r.n_tokens == parts[-1][2] and r.seq_id == parts[-1][1] + 1:
            parts[-1][1] = r.seq_id
        else:
            parts.append([r.seq_id, r.seq_id, r.n_tokens])
    return " ".join(f"{a}{f'-{b}' if b != a else ''}:{n}" for a, b, n in parts)


def summarize(rows: list[dict]) -> dict:
    def mean(key: str, subset: list[dict]) -> float | None:
        values = [r[key] for r in subset if r[key] is not None]
        return float(np.mean(values)) if values else None

    mixed = [r for r in rows if r["mixed"]]
    decode_only = [r for r in rows if not r["mixed"]]
    groups = {"all": rows, "decode-only": decode_only, "with prompt tokens": mixed}
    return {
        "ticks": len(rows), "decode_only_ticks": len(decode_only), "mixed_ticks": len(mixed),
        "passes_per_tick": {name: {"model": mean("passes_model", g), "llama.cpp": mean("passes", g)}
                            for name, g in groups.items()},
        "model_matches": sum(r["passes"] == r["passes_model"] for r in rows),
        "prefill_tokens_per_mixed_tick": mean("prefill", mixed),
        "mixed_ticks_by_passes": dict(sorted(collections.Counter(r["passes"] for r in mixed).items())),
        "unified_kv_model_passes_per_tick": mean("unified_model", rows),
        "passes": sum(r["passes"] for r in rows), "graphs_reused": sum(r["reused"] for r in rows),
        "graphs_reused_decode_only": sum(r["reused"] for r in decode_only),
        "passes_decode_only": sum(r["passes"] for r in decode_only),
        "output_rows_per_tick": mean("outputs", rows),
        "raw_logits_rows_per_tick": {"model": mean("raw_rows_model", rows), "llama.cpp": mean("raw_rows", rows)},
        "raw_rows_unknown": sum(r["raw_rows"] is None for r in rows),
        "sampled_logits_rows_per_tick": mean("sampled_rows", rows),
    }


def report(s: dict) -> None:
    print(f"  {s['ticks']} ticks, {s['decode_only_ticks']} decode-only, {s['mixed_ticks']} with prompt tokens")
    for name, p in s["passes_per_tick"].items():
        if p["model"] is not None:
            print(f"  passes per tick, {name}: model {p['model']:.3f}, llama.cpp {p['llama.cpp']:.3f}")
    print(f"  model = llama.cpp on {s['model_matches']} of {s['ticks']} ticks; ticks with prompt tokens by "
          f"passes: {s['mixed_ticks_by_passes']}; a unified KV would run {s['unified_kv_model_passes_per_tick']:.3f}")
    print(f"  prompt tokens per tick with prompt tokens: {s['prefill_tokens_per_mixed_tick']:.1f}")
    print(f"  graphs reused: {s['graphs_reused']} of {s['passes']} passes; on decode-only ticks "
          f"{s['graphs_reused_decode_only']} of {s['passes_decode_only']}")
    raw = s["raw_logits_rows_per_tick"]
    print(f"  logits rows per tick: {s['output_rows_per_tick']:.2f} output rows; copied to the host's logits: "
          f"model {raw['model']:.2f}, llama.cpp {raw['llama.cpp']:.2f} ({s['raw_rows_unknown']} ticks unknown); "
          f"copied into llama.cpp's sampling buffer: {s['sampled_logits_rows_per_tick']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompts", default="workloads/prompts_186.txt")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="the first N prompts (default all)")
    parser.add_argument("--max-new", type=positive_int, default=64, help="new tokens per request (ignore_eos)")
    parser.add_argument("--sampling", choices=("host", "device", "both"), default="both")
    parser.add_argument("--json", default=None, help="write the summaries here")
    parser.add_argument("--show-ticks", type=int, default=0, metavar="N",
                        help="print the rows and passes of the first N ticks with prompt tokens")
    args = parser.parse_args()
    paths = {"host": [False], "device": [True], "both": [False, True]}[args.sampling]
    layout = "a unified KV" if args.kv_unified else "per-sequence KV streams"
    layout += ", ticks kept to two passes (--two-pass-ticks)" if args.two_pass_ticks and not args.kv_unified else ""
    results = {}
    for device_sampling in paths:
        label = "greedy tokens picked in llama.cpp's graph" if device_sampling else "greedy tokens by the host's argmax"
        print(f"{args.prompts} ({args.max_new} new tokens, {args.max_slots} slots, n_batch {args.n_batch}, "
              f"chunks of {args.prefill_chunk_tokens}, {layout}), {label}:", flush=True)
        results[label] = run(args, device_sampling)
        report(results[label])
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
