"""JSONL outputs a job appends to, flushed line by line, and resumes from after a kill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def drop_cut_line(path: str | Path) -> None:
    """Drop a last line cut short by a kill from the output, so that appending resumes on a clean line."""
    path = Path(path)
    if path.is_file():
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            path.write_bytes(complete)


def finished_ids(path: str | Path, key: str = "id") -> set[Any]:
    """The `key` of every line already in the output; a last line cut short by a kill does not count."""
    path = Path(path)
    if not path.is_file():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    ids = set()
    for line in complete.decode("utf-8").splitlines():
        if line.strip():
            ids.add(json.loads(line)[key])
    return ids
