"""The GPU kit's reading of its steps' files, and its summary as Markdown and one figure (bench/gpu/kit.py
writes both next to summary.json)."""

from __future__ import annotations

import csv
import os
import subprocess
from pathlib import Path

PAPER = "paper (RTX 4070, Qwen2.5-0.5B Q5_K_M): continuous batching with split prefill 6.24x over sequential"
RATIO_KEYS = ("wall_s", "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
SWEEP_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "output_tok_s")


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


def cell(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def table2_lines(summary: dict) -> list[str]:
    lines = [f"## Table 2 ({summary['num_prompts']} prompts of prompts_186, {summary['slots']} slots, "
             f"{summary['max_new']} new tokens each)", "",
             "| config | wall s | output tok/s | speedup | host gap p50 ms |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['config']} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{r['gap_p50_ms']:.2f} |" for r in summary["table2"]["rows"]]
    host = summary["table2"]["host"]
    return [*lines, "", PAPER, "", "## Host overhead (cont-split512)", "",
            f"{host['host_ms']:.2f} ms of host work per tick of {host['tick_ms']:.2f} ms "
            f"({host['host_share']:.1%}) over {host['ticks']} ticks."]


def variant_lines(variants: list[dict]) -> list[str]:
    lines = ["", "## cont-split512 with other flags (same prompts; the flags go after the kit's own)", "",
             "| variant | flags | wall s | output tok/s | / Table 2's | host ms per tick (share) | host gap p50 ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for v in variants:
        host = v["host"]
        lines.append(f"| {v['name']} | `{' '.join(v['flags'])}` | {v['wall_s']:.2f} | {v['output_tok_s']:.1f} | "
                     f"{cell(v['vs_table2'])} | {host['host_ms']:.2f} ({host['host_share']:.1%}) | "
                     f"{v['gap_p50_ms']:.2f} |")
    return lines


def decode_lines(rows: list[dict]) -> list[str]:
    lines = ["", "## Decode-only ticks (bench/engine/decode_throughput.py, 32-token prompts, 64 new tokens, two runs)",
             "",
             "| slots | tok/s | tick ms | decode ms | host ms | of it argmax ms |", "|---:|---:|---:|---:|---:|---:|"]
    return lines + [f"| {r['slots']} | {r['tok_s']:.1f} | {r['tick_ms']:.2f} | {r['decode_ms']:.2f} | "
                    f"{r['host_ms']:.3f} | {r['argmax_ms']:.3f} |" for r in rows]


def profile_lines(p: dict) -> list[str]:
    return ["", "## Cost profile (`cobali calibrate`; `cobali simulate --profile profile.json`)", "",
            f"tick = {p['t0_s'] * 1e3:.2f} ms + {p['prefill_s_per_token'] * 1e6:.1f} us/prefill token + "
            f"{p['decode_s_per_row'] * 1e6:.1f} us/decode row + "
            f"{p['decode_s_per_kv_token'] * 1e9:.1f} ns/decode KV token"]


def peer_lines(summary: dict) -> list[str]:
    peers = summary["peers"]
    lines = ["", f"## Serving: {summary['serve_workload']} through `cobali bench serve`", "",
             "| server | " + " | ".join(RATIO_KEYS) + " |", "|---" + "|---:" * len(RATIO_KEYS) + "|"]
    for name in ("cobali", "cobali-async", "llama-server", "llama-server-bs", "ratio"):
        if name in peers:
            lines.append(f"| {name} | " + " | ".join(cell(peers[name].get(k)) for k in RATIO_KEYS) + " |")
    return lines


def capacity_text(name: str, capacity: dict) -> str:
    if capacity["rate"] is None:
        return f"{name} below the lowest rate"
    return f"{name} {capacity['rate']:g} req/s" + ("" if capacity["bounded"] else " (no rate failed)")


def sweep_lines(sweep: dict) -> list[str]:
    slo = ", ".join(f"{k} <= {v:g} ms" for k, v in sweep["slo_ms"].items())
    capacities = "; ".join(capacity_text(name, s["capacity"]) for name, s in sweep["servers"].items())
    lines = ["", f"## Poisson sweep: {sweep['prompts']}, {sweep['repeat']} arrival seeds per rate, servers in turn",
             "", f"Capacity under {slo}: {capacities}.", "",
             "| server | rate | " + " | ".join(SWEEP_KEYS) + " |", "|---|---:" + "|---:" * len(SWEEP_KEYS) + "|"]
    for name, server in sweep["servers"].items():
        lines += [f"| {name} | {row['rate']:g} | " + " | ".join(cell(row.get(k), ".1f") for k in SWEEP_KEYS) + " |"
                  for row in server["rows"]]
    return lines


def markdown(summary: dict) -> str:
    lines = [f"# cobali GPU kit: {summary['device']}", "",
             f"Model: `{summary['model']}` (random weights: its text is noise, its speed is real; ignore_eos)", ""]
    lines += table2_lines(summary)
    if summary.get("variants"):
        lines += variant_lines(summary["variants"])
    if summary.get("decode"):
        lines += decode_lines(summary["decode"])
    if summary.get("profile"):
        lines += profile_lines(summary["profile"])
    if summary.get("batched_bench"):
        lines += ["", "## llama-batched-bench ceiling", "", "| B | S_PP tok/s | S_TG tok/s |", "|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {r['s_pp_tok_s']:.1f} | {r['s_tg_tok_s']:.1f} |" for r in summary["batched_bench"]]
    if summary.get("peers"):
        lines += peer_lines(summary)
    if summary.get("sweep"):
        lines += sweep_lines(summary["sweep"])
    lines += ["", f"Skipped: {', '.join(summary['skipped'])}" if summary["skipped"] else ""]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = summary["table2"]["rows"] + [{"config": v["name"], "speedup": v["speedup"]}
                                        for v in summary.get("variants", [])]
    axes[0].bar([r["config"] for r in rows], [r["speedup"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("speedup over seq")
    axes[0].set_title(f"Table 2 on {summary['device']}")
    axes[0].tick_params(axis="x", rotation=30)
    bench = summary.get("batched_bench") or []
    if bench:
        axes[1].plot([r["batch"] for r in bench], [r["s_tg_tok_s"] for r in bench], "o-", label="llama-batched-bench")
    cont = next((r for r in summary["table2"]["rows"] if r["config"] == "cont-split512"), None)
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
