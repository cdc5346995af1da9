"""`cobali synth-model` for named shapes: time to write, file size, llama.cpp load time, and (--decode N)
N greedy tokens' speed at 1 thread with every step's logits checked finite.

    .venv/bin/python bench/models/synth_models.py --dir /tmp/synth --quant Q5_K_M [--decode 16] \\
        qwen2.5-0.5b llama-3.2-1b ...

Models already in --dir are reused (their write time is then not re-measured). Load time: loading the
GGUF and creating a 1-sequence context, the page cache warm (the file was just written or read).
Decode speed: bench/engine/decode_throughput.py --model FILE --max-slots N (with ignore_eos, as any benchmark of
a dummy model must: its text is noise, its speed is real).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from cobali.backends.embedded_model import embedded_model_path
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.faces.synth_model import QUANT_TYPES, SHAPES, check_decode, synth_model


def measure(name: str, quant: str, folder: Path, n_decode: int | None) -> dict:
    path = folder / f"{name}-{quant}.gguf"
    row = {"shape": name, "quant": quant, "params_b": SHAPES[name].n_params / 1e9, "file": str(path)}
    if not path.exists():
        start = time.perf_counter()
        synth_model(SHAPES[name], quant, str(path), embedded_model_path())
        row["write_s"] = time.perf_counter() - start
    row["size_mib"] = os.path.getsize(path) / 2**20
    start = time.perf_counter()
    backend = LlamaCppBackend(LlamaCppConfig(str(path), n_ctx=512, n_seq_max=1, n_batch=64))
    row["load_s"] = time.perf_counter() - start
    row["description"] = backend.info.description
    backend.close()
    if n_decode:
        check = check_decode(str(path), n_decode, n_threads=1)
        row.update(decode_tok_s=check.tok_s, non_finite_steps=check.non_finite)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", choices=sorted(SHAPES))
    parser.add_argument("--quant", default="Q5_K_M", choices=QUANT_TYPES)
    parser.add_argument("--dir", required=True, help="where the models are written (they are large)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--decode", type=int, default=None, metavar="N", help="greedy-decode N tokens, 1 thread")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'shape':<14}{'params':>8}{'quant':>8}{'MiB':>9}{'write s':>9}{'load s':>8}{'tok/s':>8}{'non-finite':>11}")
    for name in args.shapes:
        row = measure(name, args.quant, folder, args.decode)
        rows.append(row)
        write = f"{row['write_s']:.0f}" if "write_s" in row else "-"
        decode = f"{row['decode_tok_s']:>8.2f}{row['non_finite_steps']:>11}" if args.decode else ""
        print(f"{name:<14}{row['params_b']:>7.2f}B{args.quant:>8}{row['size_mib']:>9.0f}{write:>9}{row['load_s']:>8.2f}"
              f"{decode}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
