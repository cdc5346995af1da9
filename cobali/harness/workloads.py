"""What a run feeds the engine: prompts files, named scenarios, random token prompts, and arrival times.

Workload files: `.txt` (one prompt a line), `.jsonl` ({"prompt", "max_tokens"?} a line), or a JSON
scenario {"name", "description", "max_tokens"?, "requests": [{"prompt", "max_tokens"?}, ...]}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class WorkItem:
    prompt: str | list[int]  # text, or token ids (synthetic workloads)
    max_tokens: int | None = None  # None: the run's --max-new


def load_workload(path: str | Path) -> list[WorkItem]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        items = [WorkItem(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".jsonl":
        items = [_item(json.loads(line), path, n) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif path.suffix == ".json":
        items = _scenario(json.loads(text), path)
    else:
        raise ValueError(f"prompts file {path}: expected .txt, .jsonl or .json")
    if not items:
        raise ValueError(f"prompts file {path} has no prompts")
    return items


def _scenario(data: object, path: Path) -> list[WorkItem]:
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list):
        raise ValueError(f"scenario {path}: expected an object with a 'requests' list")
    default = data.get("max_tokens")
    items = [_item(entry, path, n) for n, entry in enumerate(data["requests"], 1)]
    return [WorkItem(i.prompt, i.max_tokens or default) for i in items]


def _item(entry: object, path: Path, n: int) -> WorkItem:
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
        raise ValueError(f"{path} entry {n}: expected an object with a string 'prompt'")
    return WorkItem(entry["prompt"], entry_max_tokens(entry, f"{path} entry {n}"))


def entry_max_tokens(entry: dict, where: str) -> int | None:
    """An input entry's optional max_tokens (None: the run's default); `where` names the entry in the error."""
    max_tokens = entry.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    return max_tokens


# The repo's workloads/ folder; a bare scenario name resolves against it (then against ./workloads).
WORKLOADS_DIRS = (Path(__file__).resolve().parents[1] / "workloads", Path("workloads"))


def resolve_prompts(spec: str, flag: str = "--prompts") -> Path:
    """A path as given, or a scenario name such as `mixed_length` -> workloads/mixed_length.json."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix == "" and len(path.parts) == 1:
        for folder in WORKLOADS_DIRS:
            candidate = folder / f"{spec}.json"
            if candidate.is_file():
                return candidate
        known = ", ".join(sorted({p.stem for d in WORKLOADS_DIRS if d.is_dir() for p in d.glob("*.json")}))
        raise ValueError(f"{flag} {spec!r}: no such file or scenario (scenarios: {known or 'none'})")
    raise ValueError(f"{flag} {spec!r}: no such file")


def load_items(spec: str, num_prompts: int | None = None, flag: str = "--prompts") -> list[WorkItem]:
    items = load_workload(resolve_prompts(spec, flag))
    return items[:num_prompts] if num_prompts else items


def random_items(num_prompts: int, input_len: int, output_len: int, range_ratio: float, n_vocab: int,
                 seed: int = 0) -> list[WorkItem]:
    """Token-id prompts with lengths uniform in [len*(1-r), len*(1+r)], as vLLM's random dataset draws them.

    Ids avoid both ends of the vocabulary, where special and control tokens usually sit."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    margin = min(100, n_vocab // 4)
    low, high = margin, max(margin + 1, n_vocab - margin)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    return [WorkItem(rng.integers(low, high, size=n).tolist(), int(m))
            for n, m in zip(in_lens, out_lens, strict=True)]


def _lengths(rng: np.random.Generator, count: int, mean: int, range_ratio: float) -> np.ndarray:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def inter_arrivals(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Gaps between arrivals (s): gamma with shape `burstiness` and mean 1/rate, so burstiness 1 is a
    Poisson process, < 1 burstier, > 1 more regular (vLLM's definition)."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if np.isinf(rate):
        return np.zeros(count)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count)


def arrival_offsets(count: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival time of each request after the start (s); the first arrives at once."""
    gaps = inter_arrivals(count, rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if count else gaps
