"""Workload files: `.txt` (one prompt a line), `.jsonl` ({"prompt", "max_tokens"?} a line), or a JSON
scenario {"name", "description", "max_tokens"?, "requests": [{"prompt", "max_tokens"?}, ...]}."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


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
    max_tokens = entry.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{path} entry {n}: max_tokens must be a positive integer, got {max_tokens!r}")
    return WorkItem(entry["prompt"], max_tokens)
