"""Lines of Python per layer of the cobali package, for any checkout: a table of lines and files per layer, each
layer's packages and modules by size.

    .venv/bin/python bench/code/lines_per_layer.py [REPO]      # default: this repository

A top-level package is counted in the layer tests/unit/test_layers.py gives it, with the server, batch jobs, the
simulator and Ray counted with the faces they serve. Names only older checkouts have are placed where their code
lives now, module by module where a package was split, so that two checkouts compare like for like.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

LAYERS = ("faces", "config", "harness", "frontend", "engine", "structured", "backends")
LAYER_OF = {
    **dict.fromkeys(("faces", "ray", "http", "batch", "sim"), "faces"),
    **{layer: layer for layer in ("config", "harness", "frontend", "engine", "structured", "backends")},
    "__init__": "frontend",  # the package's names: the engine's values and the offline API
}
# Older checkouts' names. server/ became http/ (a face) but for what the frontend and structured now hold.
FORMER = {
    # before issue 45: faces, flags and shared values at the package root
    **dict.fromkeys(("cli", "run", "calibrate", "synth", "synth_lora"), "faces"),
    **dict.fromkeys(("settings", "options", "config"), "config"),
    **dict.fromkeys(("runner", "latency", "workloads", "jsonl"), "harness"),
    "offline": "frontend",
    **dict.fromkeys(("harness/cli", "harness/fidelity_cli", "harness/sweep_cli"), "faces"),
    "bench": "harness",  # now harness/
    "metrics": "harness",  # now harness/latency.py
    "costs": "engine",  # now engine/costs.py, with the online fit
    "model": "backends",  # now backends/llama_cpp/
    "server": "faces",
    **dict.fromkeys((f"server/{name}" for name in ("chat_template", "engine_thread", "errors", "generation",
                                                   "request_limits", "tool_calls", "work_pool")), "frontend"),
    # grammar compilers of cobali's own, before llguidance
    **dict.fromkeys((f"server/{name}" for name in ("gbnf", "grammar", "integer_grammar", "json_schema_grammar",
                                                   "regex_grammar", "schema_merge")), "structured"),
}


def layer_of(parts: tuple[str, ...]) -> str | None:
    """The layer of the module at `parts` (its path under cobali/, without .py); None if no layer names it."""
    return FORMER.get("/".join(parts[:2])) or LAYER_OF.get(parts[0]) or FORMER.get(parts[0])


def count(package: Path) -> tuple[Counter[tuple[str, str]], Counter[str]]:
    """Lines by (layer, top-level name) and files by layer; SystemExit naming any module no layer places."""
    lines: Counter[tuple[str, str]] = Counter()
    files: Counter[str] = Counter()
    unplaced = set()
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        layer = layer_of(parts)
        if layer is None:
            unplaced.add(parts[0])
            continue
        lines[layer, parts[0]] += len(path.read_text().splitlines())
        files[layer] += 1
    if unplaced:
        raise SystemExit(f"no layer for {', '.join(sorted(unplaced))}: add it to LAYER_OF or FORMER")
    return lines, files


def main() -> None:
    repo = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
    lines, files = count(repo / "cobali")
    print(f"{'layer':<11}{'lines':>6}{'files':>7}   by package or module")
    for layer in LAYERS:
        parts = sorted(((n, part) for (lay, part), n in lines.items() if lay == layer), reverse=True)
        total = sum(n for n, _ in parts)
        print(f"{layer:<11}{total:>6}{files[layer]:>7}   " + ", ".join(f"{part} {n}" for n, part in parts))
    print(f"{'total':<11}{sum(lines.values()):>6}{sum(files.values()):>7}")


if __name__ == "__main__":
    main()
