"""Every script in bench/ runs at its smallest setting, so that a change to the engine, the backend seam or the
server that breaks one fails here rather than on the day someone needs its figures. Nothing is measured: a script
passes when it exits 0 and prints the line that carries its result.

Each script needs nothing from outside but the embedded model (no llama-server, llama-batched-bench, GPU or
download), except those in ELSEWHERE, which say where they run or why they cannot. A new script must join
SMOKE (or a test below) or ELSEWHERE: test_every_script_is_run_or_excused fails until it does. The runs marked
slow (a minute or more each) belong in .ci/run's slow set.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import require_embedded_model
from tests.integration.test_server_openai import running_server
from tests.unit.http.test_reliability import soak_module

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
COBALI = str(Path(sys.executable).with_name("cobali"))
PROMPTS = "Name three colors.\nWhat is two plus two?\n"  # two short prompts: a prefill is a few ms


@dataclass(frozen=True)
class Run:
    """One script's smallest command line ({tmp}: a fresh folder, {prompts}: PROMPTS as a file, {port}: a free
    port), the text its output must hold, whether it loads the embedded model, and its environment's additions."""

    script: str
    args: str
    expect: str
    model: bool = True
    env: dict[str, str] = field(default_factory=dict)


SMOKE = [
    Run("code/lines_per_layer.py", "", "total", model=False),
    Run("engine/host_overhead.py", "--slots 4 --ticks 3 --n-vocab 256", "host ms/tick", model=False),
    Run("engine/sleeping_backend.py", "--concurrency 4 --seconds 0.4 --max-tokens 8 --sleep-ms 1 --n-vocab 256 "
        "--async-scheduling --serve --stream-interval 2 --port {port}", "server async", model=False),
    Run("engine/host_thread.py", "--concurrency 4 --seconds 0.4 --max-tokens 8 --stream-interval 2",
        "ms CPU per tick", model=False),
    Run("engine/admission_cost.py", "--slots 16 64 --cycles 20 --repeats 1", "assign_us", model=False),
    Run("engine/routing_report.py", "--slots 4 --prefix-tokens 128 --host-prefixes 2", "busy  repeat", model=False),
    Run("engine/admission_sources.py", "--slots 4 16 --cycles 3 --repeats 1", "per admission", model=False),
    Run("engine/detok_cost.py", "--tokens 500 --repeats 1", "µs/token"),
    Run("engine/backend_sampling_churn.py", "--slots 2 --threads 1 --ticks 2", "attached or detached"),
    Run("engine/costfit_convergence.py", "--prompts {prompts} --max-new 4 --threads 1 --out {tmp}", "ticks.csv"),
    Run("engine/decode_throughput.py", "--max-slots 2 --prompt-tokens 8 --gen-tokens 4 --threads 1 "
        "--both-sampling-paths", "tok/s"),
    Run("engine/kv_streams.py", "--rows 2 --slots 4 --depth 8 --idle-depth 8 --threads 1 --repeat 1", "moved first"),
    Run("engine/mixed_ubatches.py", "--decode-rows 2 --depth 8 --prompts 2 --prompt-tokens 8 --gap 1 --threads 1 "
        "--repeat 1", "scattered"),
    Run("engine/passes_per_tick.py", "--prompts {prompts} --max-new 4 --threads 1 --max-slots 2", "passes"),
    Run("engine/prefill_tile.py", "--depths 0 --sizes 8 --decode-rows 1 --threads 1 --repeat 1", "depth"),
    Run("engine/prefix_reuse.py", "--chats 2 --system-tokens 20 --max-new 2 --threads 1 --max-slots 2", "2 chats"),
    Run("engine/token_only_greedy.py", "--slots 2 --threads 1 --rounds 1 --ticks 1", "token-only"),
    Run("engine/repack_ab.py", "--rounds 1 --repeats 1 --prefill-tokens 64 --slots 2 --kv 8 --threads 1",
        "prefill_tok_s"),
    Run("models/kv_cache_types.py", "--types f16,q8_0 --prompt-tokens 8 --gen-tokens 2 --repeat 1 --max-slots 2 "
        "--threads 1 --fidelity-prompts {prompts} --fidelity-max-new 2", "| q8_0 |"),
    Run("models/speculative.py", "--prompts {prompts} --num-prompts 2 --k 0,2 --rounds 1 --threads 1 --position 8 "
        "--repeat 1 --max-new 4", "TPOT p50"),
    Run("models/lora.py", "--prompts {prompts} --num-prompts 2 --slots 2 --max-new 2 --rank 2 --rounds 1 --threads 1",
        "half"),
    Run("models/synth_models.py", "--dir {tmp} --quant Q8_0 --decode 2 tiny", "tiny"),
    Run("serving/parse_lag.py", "--scale 0.001 --only detokenize --repeat 1 --port {port}", "detokenize",
        model=False),
    Run("serving/soak.py", "--requests 8 --concurrency 4 --max-tokens 4 --time-limit 60 "
        "--serve-flags '--threads 1 --max-slots 4'", "completed"),
    Run("serving/ttft_tools.py", "--rounds 1 --requests 1", "TTFT"),
    Run("sim/routing.py", "--replicas 2 --customers-per-replica 1 --users 2 --turns 2 --context-tokens 256 "
        "--rate-per-replica 2", "least-tokens", model=False),
    Run("sim/deadline_budget_sim.py", "--rates inf -- --prompts {prompts} --max-new 4 --max-slots 2", "inf",
        model=False),
    Run("structured/grammar_sampling.py", "--requests 1 --slots 1 --max-new 4 --rounds 1 --threads 1", "regex"),
    Run("structured/schema_corpus.py", "--corpus {tmp} --packages", "packages:", model=False),
    Run("structured/schema_coverage.py", "--only ^pydantic/address$ --max-tokens 16 --concurrency 1 "
        "--out {tmp}/coverage.json", "valid outputs / schemas: "),
    Run("tools/held_out_workload.py", "--out {tmp}/held_out.json --requests 2", "held_out.json", model=False),
]
SLOW = [
    Run("engine/fidelity_matrix.sh", "{tmp}", "PASS", env={"THREADS": "1", "NUM_PROMPTS": "2", "MAX_NEW": "2",
                                                         "COBALI": COBALI}),
    Run("serving/batch_ray.py", "--prompts 4 --max-new 2 --replicas 1 --out {tmp}", "as one process"),
]
RUN_BY_TESTS_BELOW = ("engine/slot_gaps.py", "sim/sim_vs_real.py", "serving/idle_stream.py",
                      "structured/structured_vs_servers.py", "serving/many_models.py",
                      "serving/many_models_client.py", "serving/many_models_servers.py")
ELSEWHERE = {
    "gpu/kit.py": "tests/integration/test_gpu_kit.py runs the kit on CPU",
    "gpu/kit_report.py": "tests/integration/test_gpu_kit.py (kit.py writes its summary with it)",
    "gpu/run.sh": "tests/integration/test_gpu_kit.py",
    "gpu/pack.sh": "downloads llama-cpp-python's sdist and wheels",
    "tools/build_llama_tools.sh": "downloads and builds llama.cpp's llama-server and llama-batched-bench",
    "serving/vs_llama_server.sh": "runs llama-server (tools/build_llama_tools.sh)",
    "parsers/linearity.py": "tests/unit/frontend/test_reasoning_parsers_linear.py runs it with --smoke",
}


def run_script(script: str, args: list[str], env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    command = ["bash"] if script.endswith(".sh") else [sys.executable]
    return subprocess.run([*command, str(BENCH / script), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def check(done: subprocess.CompletedProcess, expect: str) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert expect in done.stdout, done.stdout[-3000:]


def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS)
    return path


def smoke(run: Run, tmp_path: Path) -> None:
    if run.model:
        require_embedded_model()
    out = tmp_path / "out"
    out.mkdir()
    fields = {"tmp": str(out), "prompts": str(prompts_file(tmp_path)), "port": str(soak_module().free_port())}
    check(run_script(run.script, shlex.split(run.args.format(**fields)), run.env), run.expect)


@pytest.mark.parametrize("run", SMOKE, ids=lambda r: r.script)
def test_the_script_runs_at_its_smallest_setting(run: Run, tmp_path: Path) -> None:
    smoke(run, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("run", SLOW, ids=lambda r: r.script)
def test_the_slow_script_runs_at_its_smallest_setting(run: Run, tmp_path: Path) -> None:
    smoke(run, tmp_path)


def test_the_tick_readers_read_a_real_runs_ticks(tmp_path: Path) -> None:
    """slot_gaps.py and sim_vs_real.py read the ticks file of a `cobali bench` run: one of two requests."""
    model = require_embedded_model()
    flags = ["--prompts", str(prompts_file(tmp_path)), "--max-new", "4", "--max-slots", "2"]
    bench = subprocess.run([COBALI, "bench", "--model", model, "--threads", "1", "--configs", "cont", *flags,
                            "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    ticks = str(tmp_path / "run" / "ticks_cont.csv")
    check(run_script("engine/slot_gaps.py", [ticks]), "ticks_cont.csv")
    check(run_script("sim/sim_vs_real.py", [ticks, *flags]), "same decode rows and prefill tokens")


def test_the_clients_of_a_running_server_run_against_cobali_serve() -> None:
    """idle_stream.py and structured_vs_servers.py drive servers already up: one `cobali serve` here."""
    require_embedded_model()
    with running_server("--max-slots", "2") as (base, _):
        check(run_script("serving/idle_stream.py", ["--url", f"cobali={base}", "--rounds", "1", "--requests", "1",
                                                    "--max-tokens", "4"]), "TPOT")
        check(run_script("structured/structured_vs_servers.py", ["--url", f"cobali={base}", "--rounds", "1",
                                                                 "--requests", "1", "--max-tokens", "8"]), "grammar")


def test_many_models_runs_against_cobali_serve_of_three_models(tmp_path: Path) -> None:
    """many_models.py (and its two helper modules) starts `cobali serve --models` on the embedded model under
    three names, with its default budget (two fit, three don't), and runs every phase: it exits 1 when one could
    not run."""
    model = require_embedded_model()
    args = ["--start", "cobali", "--files", *(f"{name}={model}" for name in "abc"),
            "--port", str(soak_module().free_port()), "--repeats", "1", "--clients", "2", "--requests", "4",
            "--memory-clients", "2", "--memory-requests", "6", "--max-tokens", "4", "--slots", "2", "--ctx", "512",
            "--threads", "1", "--out", str(tmp_path)]
    check(run_script("serving/many_models.py", args), "evictions cycling A, B, C")


def test_every_script_is_run_or_excused() -> None:
    scripts = {str(p.relative_to(BENCH)) for p in BENCH.rglob("*") if p.suffix in (".py", ".sh")}
    accounted = [r.script for r in SMOKE + SLOW] + list(RUN_BY_TESTS_BELOW) + list(ELSEWHERE)
    assert sorted(accounted) == sorted(set(accounted)), "a script listed twice"
    assert scripts == set(accounted), f"not run: {sorted(scripts - set(accounted))}; " \
                                      f"gone: {sorted(set(accounted) - scripts)}"


PREFIX_ROUTING = ("serving/prefix_routing.py", "serving/prefix_routing_sim.py", "serving/prefix_workload.py",
                  "serving/proc_tree.py")
RUN_BY_TESTS_BELOW += PREFIX_ROUTING  # the test below; its --launch starts Ray, which the smoke run does not


def test_prefix_routing_runs_against_cobali_serve_and_in_the_simulator() -> None:
    """prefix_routing.py's client against one `cobali serve`, then the same requests simulated (prefix_routing_sim.py,
    prefix_workload.py): eight chats of two turns over two short contexts, no request lost."""
    require_embedded_model()
    shape = ["--customers", "2", "--users", "2", "--turns", "2", "--context-tokens", "48", "--question-words", "4",
             "--answer-words", "4", "--max-tokens", "2", "--rate", "20"]
    with running_server("--max-slots", "2") as (base, _):
        check(run_script("serving/prefix_routing.py", ["--url", base, *shape]), "server        8     0")
    check(run_script("serving/prefix_routing.py", ["--sim", "--serve-flags", "--max-slots 2", "--sim-flags",
                                                   "--host-cores 2 --host-background 0.2", *shape]),
          "kv        8     0")
