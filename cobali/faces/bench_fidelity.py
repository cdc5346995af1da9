"""`cobali bench fidelity`: greedy outputs of a candidate engine configuration against the reference (each
request alone, its whole prompt in one decode), judged by the logit margin at each first divergence."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from cobali.backends.base import Backend
from cobali.config.flags import (
    add_engine_args,
    backend_config,
    engine_setup,
    flags_record,
    positive_float,
    positive_int,
)
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.policies import MODES
from cobali.engine.setup import build_backend
from cobali.harness.fidelity import EPSILON, Trace, compare_runs, greedy_traces
from cobali.harness.latency import write_json
from cobali.harness.workloads import WorkItem, load_items

# The reference decodes a whole prompt at once: one sequence, a batch as large as its context.
REFERENCE_BATCH = 2048


def register(nested: argparse._SubParsersAction) -> None:
    parser = nested.add_parser("fidelity", help="greedy outputs of engine flags vs each request run alone")
    add_engine_args(parser)
    parser.add_argument("--prompts", required=True, help="prompts file (.txt/.jsonl/.json) or a scenario name")
    parser.add_argument("--num-prompts", type=positive_int, default=None, help="use the first N prompts")
    parser.add_argument("--max-new", type=positive_int, default=32,
                        help="greedy tokens per request (a scenario's own max_tokens wins)")
    parser.add_argument("--mode", choices=MODES, default="cont", help="the candidate's scheduling mode")
    parser.add_argument("--system-prompt-file", default=None,
                        help="text put before every prompt (a shared prefix for the prefix cache)")
    parser.add_argument("--epsilon", type=positive_float, default=EPSILON,
                        help=f"largest reference margin (nats) at which a divergence is noise (default {EPSILON})")
    parser.add_argument("--out", default=None, help="directory for fidelity.json (per-request detail)")
    parser.set_defaults(func=fidelity_command)


def fidelity_command(args: argparse.Namespace) -> int:
    items = with_system_prompt(load_items(args.prompts, args.num_prompts), args.system_prompt_file)
    reference = run_reference(args, items)
    spec = engine_setup(args, args.mode)
    backend = build_backend(spec.backend)
    info = backend.info
    try:
        engine = spec.build_engine(backend)
        candidate = greedy_traces(engine, items, args.max_new)
        totals = engine.stats()
        stats = {"preemptions": totals.preemptions, "prefix_hit_tokens": totals.prefix_hit_tokens,
                 "ticks": len(engine.ticks), "backend": asdict(info)}
    finally:
        backend.close()
    report = compare_runs(reference, candidate, args.epsilon)
    print(f"cobali bench fidelity: {len(items)} prompts; candidate: mode {args.mode}, {args.max_slots} slots, "
          f"chunk {args.prefill_chunk_tokens}, {info.description}, n_ctx {info.n_ctx}; "
          f"{stats['preemptions']} preemptions, {stats['prefix_hit_tokens']} prompt tokens from the prefix cache")
    print(report.describe())
    if args.out:
        path = write_json(Path(args.out) / "fidelity.json", {"candidate": flags_record(args), "candidate_stats": stats,
                                                              **report.as_dict()})
        print(f"wrote {path}")
    return 0 if report.passed else 1


def with_system_prompt(items: list[WorkItem], path: str | None) -> list[WorkItem]:
    if path is None:
        return items
    try:
        system = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ValueError(f"--system-prompt-file {path!r}: {err.strerror}") from None
    if not system:
        raise ValueError(f"--system-prompt-file {path!r} is empty")
    if any(not isinstance(item.prompt, str) for item in items):
        raise ValueError("--system-prompt-file needs text prompts, not token ids")
    return [replace(item, prompt=f"{system}\n\n{item.prompt}") for item in items]


def run_reference(args: argparse.Namespace, items: list[WorkItem]) -> list[Trace]:
    reference = replace(backend_config(args), n_seq_max=1, n_batch=REFERENCE_BATCH, n_ctx=0, kv_unified=False)
    backend: Backend = build_backend(reference)
    try:
        n_batch = backend.info.n_batch  # llama.cpp caps the batch at the context
        config = EngineConfig(mode="seq", max_slots=1, n_batch=n_batch, prefill_chunk_tokens=n_batch,
                              prefix_cache=False)
        return greedy_traces(Engine(backend, config), items, args.max_new)
    finally:
        backend.close()

