"""`cobali batch` on 200 prompts: one process vs Ray workers, and a resume after a kill.

    .venv/bin/python bench/serving/batch_ray.py [--prompts 200] [--max-new 16] [--replicas 2]

Three runs over the same JSONL (greedy), all with 16 slots per engine: (1) one engine with all cores;
(2) `--ray --replicas N`, one engine of 1 thread per worker; (3) one engine again, killed (SIGKILL) once a
quarter of the results are written, then rerun with the same command. Prints wall times, and how many
outputs of (2) and (3) equal (1) by id. Needs the `ray` extra for run (2).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, n: int) -> None:
    lines = [line for line in (ROOT / "workloads/prompts_186.txt").read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps({"id": f"p{i:03d}", "prompt": lines[i % len(lines)] + f" (#{i})"}) + "\n"
                            for i in range(n)))


def batch(source: Path, output: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [str(ROOT / ".venv/bin/cobali"), "batch", "--input", str(source), "--output", str(output),
            "--max-new", str(args.max_new), *extra]


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def results(path: Path) -> dict[str, dict]:
    return {entry["id"]: entry for entry in map(json.loads, path.read_text().splitlines())}


def killed_then_resumed(cmd: list[str], output: Path, kill_at: int) -> tuple[int, float]:
    """Kill the run once `kill_at` results are written; return (lines at the kill, the rerun's wall)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and (not output.exists() or len(output.read_text().splitlines()) < kill_at):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = len(output.read_text().splitlines())
    return at_kill, timed(cmd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-new", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--out", default="results/batch_ray")
    args = parser.parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    source = out / "prompts.jsonl"
    write_prompts(source, args.prompts)
    for name in ("local", "ray", "resumed"):
        (out / f"{name}.jsonl").unlink(missing_ok=True)

    local_s = timed(batch(source, out / "local.jsonl", args, "--max-slots", "16"))
    ray_s = timed(batch(source, out / "ray.jsonl", args, "--ray", "--replicas", str(args.replicas),
                        "--threads", "1", "--max-slots", "16"))
    at_kill, rerun_s = killed_then_resumed(batch(source, out / "resumed.jsonl", args, "--max-slots", "16"),
                                           out / "resumed.jsonl", args.prompts // 4)

    reference = results(out / "local.jsonl")
    print(f"{args.prompts} prompts, {args.max_new} new tokens each (greedy)")
    print(f"one process (16 slots, 2 threads):           {local_s:6.1f} s")
    print(f"Ray, {args.replicas} workers (16 slots, 1 thread each):  {ray_s:6.1f} s")
    print(f"killed at {at_kill} results, rerun finished in {rerun_s:6.1f} s")
    for name in ("ray", "resumed"):
        lines = (out / f"{name}.jsonl").read_text().splitlines()
        got = results(out / f"{name}.jsonl")
        same = sum(got[i]["text"] == reference[i]["text"] for i in reference if i in got)
        print(f"{name}: {len(lines)} lines, {len(got)} distinct ids, {same}/{len(reference)} texts as one process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
