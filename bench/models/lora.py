"""What LoRA adapters cost: the same requests on the base model, all on one adapter, and split between the base
model and the adapter (whose ticks then take turns), back to back on one model load.

    .venv/bin/python bench/models/lora.py --num-prompts 16 --slots 8 --max-new 64 --rounds 2

The adapter is random (`cobali synth-lora`, rank --rank on attn_q and attn_v), written to a temporary file.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.synth_lora import write_random_lora
from cobali.frontend.offline import LLM
from cobali.harness.workloads import load_items

SPLITS = {"base": lambda i: 0, "adapter": lambda i: 1, "half": lambda i: i % 2}


def run(backend: LlamaCppBackend, prompts: list[str | list[int]], slots: int, max_new: int, split: str) -> dict:
    engine = Engine(backend, EngineConfig(max_slots=slots, prefix_cache=False))
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(p, params, lora=SPLITS[split](i)) for i, p in enumerate(prompts)]
    list(LLM(engine).run())
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in requests]
    decode_s = [t.decode_s / max(1, t.plan.n_decode) for t in engine.ticks if t.plan.n_prefill_tokens == 0]
    return {"wall_s": time.perf_counter() - start, "tpot_p50_ms": statistics.median(tpot) * 1e3,
            "ms_per_decode_row": statistics.median(decode_s) * 1e3 if decode_s else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="workloads/prompts_16.txt")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    prompts = [item.prompt for item in load_items(args.prompts)[: args.num_prompts]]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = str(Path(tmp) / "adapter.gguf")
        write_random_lora(embedded_model_path(), adapter, rank=args.rank, alpha=float(args.rank))
        backend = LlamaCppBackend(LlamaCppConfig(n_seq_max=args.slots, n_threads=args.threads, lora_paths=(adapter,)))
        try:
            print(f"{'round':>5} {'requests on':>12} {'wall s':>8} {'TPOT p50 ms':>12} {'ms a decode row':>16}")
            for round_ in range(1, args.rounds + 1):
                for split in SPLITS:
                    r = run(backend, prompts, args.slots, args.max_new, split)
                    print(f"{round_:>5} {split:>12} {r['wall_s']:>8.2f} {r['tpot_p50_ms']:>12.2f} "
                          f"{r['ms_per_decode_row']:>16.2f}", flush=True)
        finally:
            backend.close()


if __name__ == "__main__":
    main()
