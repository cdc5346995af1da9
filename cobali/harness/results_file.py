"""JSONL outputs a job appends to, flushed line by line, and resumes from after a kill."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

Record = dict[str, Any]


def _always(_record: Record) -> bool:
    return True


@dataclass(frozen=True)
class ResultsFile:
    """A job's output: one JSON object a line, each result naming its input by `key`. A rerun skips the inputs
    whose results are there and `final` (False: a result to run again, such as a server error's)."""

    path: Path
    key: str = "id"
    final: Callable[[Record], bool] = _always

    def finished_ids(self) -> set[Any]:
        """The `key` of every final result; a last line cut short by a kill does not count."""
        return {record[self.key] for _, record in self._results() if self.final(record)}

    def drop_unfinished(self) -> None:
        """Keep only the final results: a last line cut short by a kill, and the results to run again, go (the
        file replaced at once, so a kill meanwhile loses nothing). Appending then resumes on a clean line."""
        if not self.path.is_file():
            return
        kept = b"".join(line for line, record in self._results() if self.final(record))
        if kept != self.path.read_bytes():
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_bytes(kept)
            os.replace(partial, self.path)

    def append(self, command: str, noun: str, total: int, todo: int,
               run: Callable[[IO[str], Callable[[], None]], int]) -> None:
        """The command's resume: says what is left of its `total` inputs, and unless nothing is, has
        run(output, on_done) append the `todo` results left (on_done() after each), with a progress bar."""
        print(f"cobali {command}: {total} {noun}, {total - todo} already in {self.path}, {todo} to run")
        if not todo:
            return
        self.drop_unfinished()
        with open(self.path, "a", encoding="utf-8") as out, \
                tqdm(total=total, initial=total - todo, unit="req", desc=command) as bar:
            written = run(out, bar.update)
        print(f"wrote {written} results to {self.path}")

    def _results(self) -> list[tuple[bytes, Record]]:
        """Each whole line (without a last one cut short) and its result. ValueError naming the file and line of
        one that is not a result of this kind (a wrong -o file, or one damaged)."""
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        results = []
        for n, line in enumerate(data[: data.rfind(b"\n") + 1].splitlines(keepends=True), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:  # not JSON, or not UTF-8
                raise ValueError(f"{self.path} line {n}: not JSON ({err}): not a results file?") from None
            if not isinstance(record, dict) or self.key not in record:
                raise ValueError(f"{self.path} line {n}: no {self.key!r}: not a results file of this command?")
            results.append((line, record))
        return results
