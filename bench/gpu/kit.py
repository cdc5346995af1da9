"""The GPU kit's measurements, once llama.cpp is built and the Python packages are importable
(bench/gpu/run.sh sets that up and calls this). Every step writes into --out; the last writes
summary.json, summary.md and kit.png there.

1. a dummy-weight model of the paper's shape (`cobali synth-model`);
2. the paper's Table 2: seq / static / cont-split512/256/128 on prompts_186 with 16 slots (ignore_eos), and
   cont-split512 with async scheduling;
3. llama-batched-bench's decode ceiling at B = 1, 16, 64;
4. cobali serve (with and without --async-scheduling) vs llama-server -np 16 through `cobali bench serve` on
   mixed_length;
5. host overhead per tick (time outside llama_decode) and its share of the tick.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from soak import started_process  # noqa: E402  (a sibling script: one way to start a server and await it)

# The paper's configs, then cont-split512 again with async scheduling (the next batch planned during the decode).
TABLE2 = "seq,static,cont-split512,cont-split256,cont-split128,cont-split512-async"
PAPER = "paper (RTX 4070, Qwen2.5-0.5B Q5_K_M): continuous batching with split prefill 6.24x over sequential"
RATIO_KEYS = ("wall_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def cobali(*argv: str) -> list[str]:
    return [sys.executable, "-m", "cobali.cli", *argv]


def run(cmd: list[str], log: Path, timeout: float = 900) -> None:
    print("$", " ".join(cmd), flush=True)
    with log.open("a") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=REPO)


def synth(args: argparse.Namespace, log: Path) -> Path:
    model = Path(args.work) / f"{args.shape}-{args.quant}.gguf"
    if not model.exists():
        extra = ["--tokenizer", args.tokenizer] if args.tokenizer else []
        run(cobali("synth-model", "--like", args.shape, "--quant", args.quant, "--out", str(model), *extra), log)
    return model


def engine_flags(args: argparse.Namespace, model: Path) -> list[str]:
    return ["--model", str(model), "--max-slots", str(args.slots), "--threads", str(args.threads)]


def table2(args: argparse.Namespace, model: Path, out: Path, log: Path) -> dict:
    folder = out / "table2"
    run(cobali("bench", *engine_flags(args, model), "--configs", TABLE2, "--prompts", "workloads/prompts_186.txt",
               "--num-prompts", str(args.num_prompts), "--max-new", str(args.max_new), "--ignore-eos",
               "--out", str(folder)), log)
    runs = json.loads((folder / "summary.json").read_text())["runs"]
    rows = [{"config": r["config"], "wall_s": r["wall_s"], "output_tok_s": r["output_tok_s"],
             "speedup": r["speedup"], "gap_p50_ms": r["gap_ms"]["p50"]} for r in runs]
    return {"rows": rows, "host": host_overhead(folder / "ticks_cont-split512.csv")}


def host_overhead(ticks_csv: Path) -> dict:
    """Host time per tick (scheduling, batch filling, sampling: everything but llama_decode), the
    analog of the paper's kernel-launch gap."""
    with ticks_csv.open() as f:
        rows = list(csv.DictReader(f))
    tick_ms = sum(float(r["end_ms"]) - float(r["start_ms"]) for r in rows)
    decode_ms = sum(float(r["decode_ms"]) for r in rows)
    n = max(len(rows), 1)
    return {"ticks": len(rows), "tick_ms": tick_ms / n, "host_ms": (tick_ms - decode_ms) / n,
            "host_share": (tick_ms - decode_ms) / tick_ms if tick_ms else None}


def batched_bench(args: argparse.Namespace, model: Path, log: Path) -> list[dict]:
    """llama.cpp's own decode ceiling: S_TG (generated tokens per second) at each batch size."""
    tool = Path(args.bin) / "llama-batched-bench"
    npl = ",".join(map(str, args.batch_sizes))
    cmd = [str(tool), "-m", str(model), "-c", str(max(args.batch_sizes) * (args.pp + args.tg + 8)),
           "-b", "2048", "-ub", "512", "-npp", str(args.pp), "-ntg", str(args.tg), "-npl", npl,
           "-t", str(args.threads or os.cpu_count()), "-ngl", str(args.n_gpu_layers)]
    print("$", " ".join(cmd), flush=True)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900).stdout
    with log.open("a") as f:
        f.write(text)
    # Result rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\|\s+\d+", line)]
    return [{"batch": int(r[2]), "s_pp_tok_s": float(r[5]), "s_tg_tok_s": float(r[7])} for r in rows]


def serve_bench(args: argparse.Namespace, url: str, name: str, out: Path, log: Path) -> dict:
    folder = out / f"serve_{name}"
    limit = ["--num-prompts", str(args.serve_prompts)] if args.serve_prompts else []
    run(cobali("bench", "serve", "--url", url, "--prompts", args.serve_workload, "--concurrency",
               str(args.concurrency), "--max-new", str(args.max_new), *limit, "--out", str(folder)), log)
    return json.loads((folder / "summary.json").read_text())["runs"][0]


def peers(args: argparse.Namespace, model: Path, out: Path, log: Path) -> dict:
    """cobali serve and llama-server -np N, each alone on the device, driven by the same client."""
    serve = [*cobali("serve", *engine_flags(args, model), "--n-gpu-layers", str(args.n_gpu_layers))]
    servers = {"cobali": [*serve, "--port"], "cobali-async": [*serve, "--async-scheduling", "--port"]}
    tool = Path(args.bin or ".") / "llama-server"
    if args.bin and tool.exists():
        servers["llama-server"] = [str(tool), "-m", str(model), "-np", str(args.slots), "-c", str(args.slots * 2048),
                                   "-t", str(args.threads or os.cpu_count()), "-b", "512", "-ub", "512",
                                   "-ngl", str(args.n_gpu_layers), "--host", "127.0.0.1", "--port"]
    results = {}
    for name, cmd in servers.items():
        with (out / f"{name}-serve.log").open("w") as server_log, \
                started_process(lambda port, cmd=cmd: [*cmd, str(port)], 300, server_log) as (url, _):
            results[name] = serve_bench(args, url, name, out, log)
    if "llama-server" in results:
        results["ratio"] = {k: results["cobali"][k] / results["llama-server"][k] for k in RATIO_KEYS
                            if results["cobali"].get(k) and results["llama-server"].get(k)}
    return results


def device_name() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    if gpu:
        return gpu
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    return f"CPU: {cpu[0].split(':', 1)[1].strip() if cpu else 'unknown'}, {os.cpu_count()} cores"


def markdown(summary: dict) -> str:
    lines = [f"# cobali GPU kit: {summary['device']}", "",
             f"Model: `{summary['model']}` (random weights: its text is noise, its speed is real; ignore_eos)", "",
             f"## Table 2 ({summary['num_prompts']} prompts of prompts_186, {summary['slots']} slots, "
             f"{summary['max_new']} new tokens each)", "",
             "| config | wall s | output tok/s | speedup | host gap p50 ms |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['gap_p50_ms']:.2f} |" for r in summary["table2"]["rows"]]
    host = summary["table2"]["host"]
    lines += ["", PAPER, "", "## Host overhead (cont-split512)", "",
              f"{host['host_ms']:.2f} ms of host work per tick of {host['tick_ms']:.2f} ms "
              f"({host['host_share']:.1%}) over {host['ticks']} ticks."]
    if summary.get("batched_bench"):
        lines += ["", "## llama-batched-bench ceiling", "", "| B | S_PP tok/s | S_TG tok/s |", "|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['s_pp_tok_s']:.1f} | {r['s_tg_tok_s']:.1f} |" for r in summary["batched_bench"]]
    peers = summary.get("peers", {})
    if peers:
        lines += ["", f"## Serving: {summary['serve_workload']} through `cobali bench serve`", "",
                  "| server | " + " | ".join(RATIO_KEYS) + " |", "|---" + "|---:" * len(RATIO_KEYS) + "|"]
        for name in ("cobali", "cobali-async", "llama-server", "ratio"):
            if name in peers:
                cells = [f"{peers[name][k]:.2f}" if peers[name].get(k) is not None else "-" for k in RATIO_KEYS]
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", f"Skipped: {', '.join(summary['skipped'])}" if summary["skipped"] else ""]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = summary["table2"]["rows"]
    axes[0].bar([r["config"] for r in rows], [r["speedup"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("speedup over seq")
    axes[0].set_title(f"Table 2 on {summary['device']}")
    axes[0].tick_params(axis="x", rotation=30)
    bench = summary.get("batched_bench") or []
    if bench:
        axes[1].plot([r["batch"] for r in bench], [r["s_tg_tok_s"] for r in bench], "o-", label="llama-batched-bench")
    cont = next((r for r in rows if r["config"] == "cont-split512"), None)
    if cont:
        label = f"cobali cont-split512, {summary['slots']} slots"
        axes[1].axhline(cont["output_tok_s"], color="tab:orange", label=label)
    axes[1].set_xlabel("batch (sequences)")
    axes[1].set_ylabel("generated tok/s")
    axes[1].set_title("decode ceiling")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", required=True, help="where the synthesized model goes")
    parser.add_argument("--bin", default=None, help="llama.cpp bin dir (llama-server, llama-batched-bench)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer GGUF for synth-model (the bundle's)")
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--quant", default="Q5_K_M")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--n-gpu-layers", type=int, default=99)
    parser.add_argument("--num-prompts", type=int, default=186)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--serve-workload", default="workloads/mixed_length.json")
    parser.add_argument("--serve-prompts", type=int, default=None, help="prompts of it (default: all)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--pp", type=int, default=128, help="batched-bench prompt tokens")
    parser.add_argument("--tg", type=int, default=128, help="batched-bench generated tokens")
    parser.add_argument("--no-serve", action="store_true", help="skip the serving comparison")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    log = out / "kit.log"
    started = time.perf_counter()
    model = synth(args, log)
    summary = {"device": device_name(), "model": model.name, "slots": args.slots, "num_prompts": args.num_prompts,
               "max_new": args.max_new, "serve_workload": Path(args.serve_workload).stem, "skipped": []}
    summary["table2"] = table2(args, model, out, log)
    if args.bin and (Path(args.bin) / "llama-batched-bench").exists():
        summary["batched_bench"] = batched_bench(args, model, log)
    else:
        summary["skipped"].append("llama-batched-bench (no --bin)")
    if args.no_serve:
        summary["skipped"].append("serving comparison (--no-serve)")
    else:
        summary["peers"] = peers(args, model, out, log)
        if "llama-server" not in summary["peers"]:
            summary["skipped"].append("llama-server (no --bin)")
    summary["kit_s"] = time.perf_counter() - started
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out / "kit.png")
    print(markdown(summary))


if __name__ == "__main__":
    main()
