"""Offline batch jobs: a JSONL of prompts in, a JSONL of results out, resumable.

Input lines: {"id"?: any JSON scalar, "prompt": str, "max_tokens"?: int}; without an id, the line
number (1-based) is the id. Output lines: {"id", "text", "finish_reason", "prompt_tokens",
"output_tokens"} (plus "error" when the request failed), appended and flushed as each request finishes,
so a killed job keeps everything finished so far and a rerun skips the ids already in the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cobali.batch.driver import Driver, Pending
from cobali.engine.engine import Engine
from cobali.engine.request import Request
from cobali.engine.sampling import SamplingParams
from cobali.runner import request_record

OUTPUT_FIELDS = ("text", "finish_reason", "prompt_tokens", "output_tokens")
JobId = str | int | float | bool | None


@dataclass(frozen=True)
class Job:
    id: JobId
    prompt: str
    max_tokens: int | None = None


def read_jobs(path: str | Path) -> list[Job]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file not found: {path}")
    jobs, seen = [], set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {n}: not JSON ({err})") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
            raise ValueError(f"{path} line {n}: expected an object with a string 'prompt'")
        job_id, max_tokens = entry.get("id", n), entry.get("max_tokens")
        if isinstance(job_id, dict | list):
            raise ValueError(f"{path} line {n}: 'id' must be a string or a number")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"{path} line {n}: max_tokens must be a positive integer, got {max_tokens!r}")
        if job_id in seen:
            raise ValueError(f"{path} line {n}: id {job_id!r} appears twice")
        seen.add(job_id)
        jobs.append(Job(job_id, entry["prompt"], max_tokens))
    return jobs


def finished_ids(path: str | Path) -> set[JobId]:
    """Ids already in the output. A last line cut short by a kill is dropped from the file, so appending
    resumes on a clean line."""
    path = Path(path)
    if not path.is_file():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        path.write_bytes(complete)
    ids = set()
    for line in complete.decode("utf-8").splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


def output_line(job_id: JobId, request: Request) -> str:
    record = request_record(request)
    out = {"id": job_id, **{k: record[k] for k in OUTPUT_FIELDS}}
    if record["error"] is not None:
        out["error"] = record["error"]
    return json.dumps(out, ensure_ascii=False)


def run_jobs(engine: Engine, jobs: Iterable[Job], out: IO[str], max_new: int,
             on_done: Callable[[], None] | None = None) -> int:
    """Generate every job (greedy), writing each result as it finishes; returns how many were written."""
    driver = Driver(engine)
    for job in jobs:
        driver.push(Pending(job.id, job.prompt, SamplingParams(max_tokens=job.max_tokens or max_new)))
    written = 0
    while driver.has_work:
        for job_id, request in driver.step():
            out.write(output_line(job_id, request) + "\n")
            out.flush()
            written += 1
            if on_done is not None:
                on_done()
    return written


def pending_jobs(jobs: Sequence[Job], output: str | Path) -> list[Job]:
    done = finished_ids(output)
    return [job for job in jobs if job.id not in done]
