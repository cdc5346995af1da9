"""The GPU kit's measurements, once llama.cpp is built and the Python packages are importable (bench/gpu/run.sh
sets that up and calls this). Every step writes into --out; the last writes summary.json, summary.md and kit.png.

1. a dummy-weight model of the paper's shape (`cobali synth-model`);
2. the paper's Table 2: seq / static / cont-split512/256/128 on prompts_186 with 16 slots (ignore_eos), and
   cont-split512 with async scheduling;
3. cont-split512 again with other flags (fewer llama.cpp threads, a unified KV, 64 slots, backend sampling,
   speculative decoding by prompt lookup at 16 slots and at 1: against the seq row),
   decode-only runs with the argmax timed apart, and `cobali calibrate`: the questions the first GPU run left open;
4. llama-batched-bench's decode ceiling at B = 1, 16, 64;
5. cobali serve (with and without --async-scheduling) vs llama-server -np 16 (without and with its backend
   sampling) in turn, all requests at once;
6. the servers (and cobali --no-compact-slots) under Poisson arrivals, in turn (`bench serve --sweep`), with capacity;
7. host overhead per tick (time outside llama_decode) and its share of the tick.
A step whose results are already in --out is not run again, so a call cut short by --deadline-s (exit 75)
continues where it stopped when the same command is sent again.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "serving"))
from kit_report import RATIO_KEYS, device_name, host_overhead, markdown, plot  # noqa: E402  (a sibling)
from soak import started_process  # noqa: E402  (bench/serving's: one way to start a server and await it)

TABLE2 = "seq,static,cont-split512,cont-split256,cont-split128,cont-split512-async"
VARIANTS = {"threads1": ["--threads", "1"], "threads4": ["--threads", "4"], "kv-unified": ["--kv-unified"],
            "slots64": ["--max-slots", "64"], "slots64-backend-sampling": ["--max-slots", "64", "--backend-sampling"],
            # Speculative decoding by prompt lookup: guessed rows ride the decode's weight read on a GPU, where on
            # the 2-core CPU each costs what a prompt token does (only a lone request gained there, ~10 %).
            "spec3": ["--num-speculative-tokens", "3", "--speculative-max-batch", "64"],
            "spec3-slots1": ["--max-slots", "1", "--num-speculative-tokens", "3"]}
RESUME = 75  # run.sh's "send the same command again" status


class Kit:
    def __init__(self, args: argparse.Namespace, out: Path, deadline: float | None) -> None:
        self.args, self.out, self.deadline = args, out, deadline
        self.log = out / "kit.log"

    def run(self, cmd: list[str]) -> None:
        """Run one step's command; past the deadline it is killed (TimeoutExpired) and the kit exits 75."""
        print("$", " ".join(cmd), flush=True)
        with self.log.open("a") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, timeout=self.time_left(), cwd=REPO)

    def time_left(self) -> float:
        if self.deadline is None:
            return 1800.0
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise subprocess.TimeoutExpired("kit", 0)
        return left

    def bench(self, model: Path, folder: Path, configs: str, *flags: str) -> dict:
        """`cobali bench` on prompts_186 into `folder`, unless an earlier call already finished it."""
        if not (folder / "summary.json").exists():
            a = self.args
            self.run(cobali("bench", *engine_flags(a, model), *flags, "--configs", configs, "--prompts",
                            "workloads/prompts_186.txt", "--num-prompts", str(a.num_prompts), "--max-new",
                            str(a.max_new), "--ignore-eos", "--out", str(folder)))
        return json.loads((folder / "summary.json").read_text())


def cobali(*argv: str) -> list[str]:
    return [sys.executable, "-m", "cobali.faces.cli", *argv]


def synth(kit: Kit) -> Path:
    args = kit.args
    model = Path(args.work) / f"{args.shape}-{args.quant}.gguf"
    if not model.exists():
        extra = ["--tokenizer", args.tokenizer] if args.tokenizer else []
        kit.run(cobali("synth-model", "--like", args.shape, "--quant", args.quant, "--out", str(model), *extra))
    return model


def engine_flags(args: argparse.Namespace, model: Path) -> list[str]:
    return ["--model", str(model), "--max-slots", str(args.slots), "--threads", str(args.threads),
            "--n-gpu-layers", str(args.n_gpu_layers)]


def table2(kit: Kit, model: Path) -> dict:
    runs = kit.bench(model, kit.out / "table2", TABLE2)["runs"]
    rows = [{"config": r["config"], "wall_s": r["wall_s"], "output_tok_s": r["output_tok_s"],
             "speedup": r["speedup"], "gap_p50_ms": r["gap_ms"]["p50"]} for r in runs]
    return {"rows": rows, "host": host_overhead(kit.out / "table2" / "ticks_cont-split512.csv")}


def variants(kit: Kit, model: Path, table: dict) -> list[dict]:
    """cont-split512 with each variant's flags after the kit's own (the last of a repeated flag wins)."""
    base = {r["config"]: r for r in table["rows"]}
    rows = []
    for name in kit.args.variants:
        folder = kit.out / "variants" / name
        run = kit.bench(model, folder, "cont-split512", *VARIANTS[name])["runs"][0]
        rows.append({"name": name, "flags": VARIANTS[name], "wall_s": run["wall_s"],
                     "output_tok_s": run["output_tok_s"], "gap_p50_ms": run["gap_ms"]["p50"],
                     "speedup": run["output_tok_s"] / base["seq"]["output_tok_s"],
                     "vs_table2": run["output_tok_s"] / base["cont-split512"]["output_tok_s"],
                     "host": host_overhead(folder / "ticks_cont-split512.csv")})
    return rows


def decode_probe(kit: Kit, model: Path) -> list[dict]:
    """Decode-only ticks (bench/engine/decode_throughput.py): how much of the host's time per tick is the argmax."""
    rows = []
    for slots in kit.args.probe_slots:
        saved = kit.out / f"decode_{slots}.json"
        if not saved.exists():
            kit.run([sys.executable, "bench/engine/decode_throughput.py", *engine_flags(kit.args, model),
                     "--max-slots", str(slots), "--prompt-tokens", "32", "--gen-tokens", "64", "--repeat", "2",
                     "--json", str(saved)])
        rows += [{"slots": slots, **row} for row in json.loads(saved.read_text())]
    return rows


def calibrate(kit: Kit, model: Path) -> dict:
    """`cobali calibrate` on the device: a measured cost profile for `cobali simulate --profile`."""
    saved = kit.out / "profile.json"
    if not saved.exists():
        kit.run(cobali("calibrate", *engine_flags(kit.args, model), "--out", str(saved)))
    return {k: v for k, v in json.loads(saved.read_text()).items() if k != "measurements"}


def batched_bench(kit: Kit, model: Path) -> list[dict]:
    """llama.cpp's own decode ceiling: S_TG (generated tokens per second) at each batch size."""
    saved = kit.out / "batched_bench.json"
    if saved.exists():
        return json.loads(saved.read_text())
    args = kit.args
    npl = ",".join(map(str, args.batch_sizes))
    cmd = [str(Path(args.bin) / "llama-batched-bench"), "-m", str(model), "-c",
           str(max(args.batch_sizes) * (args.pp + args.tg + 8)), "-b", "2048", "-ub", "512", "-npp", str(args.pp),
           "-ntg", str(args.tg), "-npl", npl, "-t", str(args.threads or os.cpu_count()), "-ngl", str(args.n_gpu_layers)]
    print("$", " ".join(cmd), flush=True)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=kit.time_left()).stdout
    with kit.log.open("a") as f:
        f.write(text)
    # Result rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\|\s+\d+", line)]
    result = [{"batch": int(r[2]), "s_pp_tok_s": float(r[5]), "s_tg_tok_s": float(r[7])} for r in rows]
    saved.write_text(json.dumps(result))
    return result


def server_commands(args: argparse.Namespace, model: Path) -> dict[str, list[str]]:
    """Each server's command line, less the port that goes last."""
    serve = cobali("serve", *engine_flags(args, model))
    servers = {"cobali": [*serve, "--port"], "cobali-async": [*serve, "--async-scheduling", "--port"]}
    tool = Path(args.bin or ".") / "llama-server"
    if args.bin and tool.exists():
        servers["llama-server"] = [str(tool), "-m", str(model), "-np", str(args.slots), "-c", str(args.slots * 2048),
                                   "-t", str(args.threads or os.cpu_count()), "-b", "512", "-ub", "512",
                                   "-ngl", str(args.n_gpu_layers), "--host", "127.0.0.1", "--port"]
        # Its backend sampling: no logits copied out, no sampling on the CPU (llama.cpp issue 27050: +48 % at 32 slots).
        servers["llama-server-bs"] = [*servers["llama-server"][:-1], "--backend-sampling", "--port"]
    return servers


def started(kit: Kit, stack: ExitStack, name: str, cmd: list[str]) -> str:
    log = stack.enter_context((kit.out / f"{name}-serve.log").open("a"))
    url, _ = stack.enter_context(started_process(lambda port: [*cmd, str(port)], 300, log))
    return url


def peers(kit: Kit, model: Path) -> dict:
    """cobali serve and llama-server -np N, each alone on the device, driven by the same client."""
    args, results = kit.args, {}
    for name, cmd in server_commands(args, model).items():
        folder = kit.out / f"serve_{name}"
        if not (folder / "summary.json").exists():
            limit = ["--num-prompts", str(args.serve_prompts)] if args.serve_prompts else []
            with ExitStack() as stack:
                url = started(kit, stack, name, cmd)
                kit.run(cobali("bench", "serve", "--url", url, "--prompts", args.serve_workload, "--concurrency",
                               str(args.concurrency), "--max-new", str(args.max_new), *limit, "--out", str(folder)))
        results[name] = json.loads((folder / "summary.json").read_text())["runs"][0]
    if "llama-server" in results:
        results["ratio"] = {k: results["cobali"][k] / results["llama-server"][k] for k in RATIO_KEYS
                            if results["cobali"].get(k) and results["llama-server"].get(k)}
    return results


def sweep(kit: Kit, model: Path) -> dict:
    """cobali serve (its defaults, and without slot compaction) and llama-server, all up, in turn at each rate."""
    args, folder = kit.args, kit.out / "sweep"
    if not (folder / "sweep.json").exists():
        servers = {k: v for k, v in server_commands(args, model).items() if k != "cobali-async"}
        servers["cobali-no-compact"] = [*servers["cobali"][:-1], "--no-compact-slots", "--port"]  # gaps between slots
        with ExitStack() as stack:
            urls = [f"{name}={started(kit, stack, name, cmd)}" for name, cmd in servers.items()]
            limit = ["--num-prompts", str(args.sweep_num_prompts)] if args.sweep_num_prompts else []
            kit.run(cobali("bench", "serve", *[f for u in urls for f in ("--url", u)], "--prompts", args.sweep_prompts,
                           *limit, "--max-new", str(args.max_new), "--sweep", args.sweep_rates, "--repeat",
                           str(args.sweep_repeat), "--capacity-steps", "0", "--out", str(folder)))
    saved = json.loads((folder / "sweep.json").read_text())
    return {"prompts": Path(args.sweep_prompts).name, "repeat": args.sweep_repeat, "slo_ms": saved["slo_ms"],
            "servers": saved["servers"]}


def int_list(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",") if n]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def variant_names(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    return names


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--variants", type=variant_names, default=list(VARIANTS),
                        help=f"comma-separated, '' for none (default: {','.join(VARIANTS)})")
    parser.add_argument("--probe-slots", type=int_list, default=[16, 64],
                        help="decode-only runs at these slot counts, argmax timed apart ('' for none)")
    parser.add_argument("--serve-workload", default="workloads/mixed_length.json")
    parser.add_argument("--serve-prompts", type=int, default=None, help="prompts of it (default: all)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--sweep-prompts", default="workloads/prompts_186.txt")
    parser.add_argument("--sweep-num-prompts", type=int, default=120, help="prompts of it (0: all)")
    parser.add_argument("--sweep-rates", default="16,32,64", help="Poisson rates (req/s), '' for no sweep")
    parser.add_argument("--sweep-repeat", type=int, default=2, help="arrival seeds per rate")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16, 64])
    parser.add_argument("--pp", type=int, default=128, help="batched-bench prompt tokens")
    parser.add_argument("--tg", type=int, default=128, help="batched-bench generated tokens")
    parser.add_argument("--no-serve", action="store_true", help="skip both serving comparisons")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="stop (exit 75) once this many seconds have passed; 0: no limit")
    return parser.parse_args()


def measure(kit: Kit) -> dict:
    args = kit.args
    model = synth(kit)
    summary = {"device": device_name(), "model": model.name, "slots": args.slots, "num_prompts": args.num_prompts,
               "max_new": args.max_new, "serve_workload": Path(args.serve_workload).stem, "skipped": []}
    summary["table2"] = table2(kit, model)
    summary["variants"] = variants(kit, model, summary["table2"])
    summary["decode"] = decode_probe(kit, model)
    summary["profile"] = calibrate(kit, model)
    if args.bin and (Path(args.bin) / "llama-batched-bench").exists():
        summary["batched_bench"] = batched_bench(kit, model)
    else:
        summary["skipped"].append("llama-batched-bench (no --bin)")
    if args.no_serve:
        summary["skipped"].append("serving comparisons (--no-serve)")
        return summary
    summary["peers"] = peers(kit, model)
    if "llama-server" not in summary["peers"]:
        summary["skipped"].append("llama-server (no --bin)")
    if args.sweep_rates:
        summary["sweep"] = sweep(kit, model)
    return summary


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    started_at = time.monotonic()
    kit = Kit(args, out, started_at + args.deadline_s if args.deadline_s > 0 else None)
    try:
        summary = measure(kit)
    except subprocess.TimeoutExpired:
        print(f"kit: stopped at its deadline ({args.deadline_s:g} s); the finished steps are kept in {out}: "
              "run the same command again to continue", file=sys.stderr)
        return RESUME
    summary["kit_s"] = time.monotonic() - started_at
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    plot(summary, out / "kit.png")
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
