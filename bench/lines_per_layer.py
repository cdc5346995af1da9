"""Lines of Python per layer of the cobali package (faces, shared, engine, backends), for any checkout.

    .venv/bin/python bench/lines_per_layer.py [REPO]      # default: this repository

A top-level module or package is counted in the layer tests/unit/test_layers.py gives it; names only older
checkouts have (model.py) are placed where their code lives now.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

LAYER_OF = {
    **dict.fromkeys(("cli", "ray", "run", "calibrate", "bench", "server", "batch", "sim", "synth"), "faces"),
    **dict.fromkeys(("options", "config", "runner", "metrics", "workloads", "costs", "__init__"), "shared"),
    "engine": "engine",
    "backends": "backends",
    "model": "backends",
}


def main() -> None:
    package = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]) / "cobali"
    by_part: Counter[str] = Counter()
    files: Counter[str] = Counter()
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        by_part[parts[0]] += len(path.read_text().splitlines())
        files[parts[0]] += 1
    by_layer: Counter[str] = Counter()
    for part, lines in by_part.items():
        by_layer[LAYER_OF[part]] += lines
    for layer in ("faces", "shared", "engine", "backends"):
        parts = ", ".join(f"{p} {by_part[p]}" for p in sorted(by_part, key=lambda p: -by_part[p])
                          if LAYER_OF[p] == layer)
        print(f"{layer:<9}{by_layer[layer]:>6}   {parts}")
    print(f"{'total':<9}{sum(by_layer.values()):>6}   {sum(files.values())} files")


if __name__ == "__main__":
    main()
