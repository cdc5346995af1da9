"""Offline batch jobs: a JSONL of prompts in, a JSONL of results out, resumable.

Input lines: {"id"?: any JSON scalar, "prompt": str, "max_tokens"?: int}; without an id, the line
number (1-based) is the id. Output lines: {"id", "text", "finish_reason", "prompt_tokens",
"output_tokens"} (plus "error" when the request failed), appended and flushed as each request finishes,
so a killed job keeps everything finished so far and a rerun skips the ids already in the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from cobali.engine.engine import Engine
from cobali.engine.outputs import RequestOutput
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM, Pending
from cobali.harness.latency import request_record
from cobali.harness.results_file import ResultsFile
from cobali.harness.workloads import entry_max_tokens

OUTPUT_FIELDS = ("text", "finish_reason", "prompt_tokens", "output_tokens")
JobId = str | int | float | bool | None


SHARD_PER_SLOT = 4  # jobs per shard per engine slot: enough to keep continuous batching full


@dataclass(frozen=True)
class Job:
    id: JobId
    prompt: str
    max_tokens: int | None = None


@dataclass(frozen=True)
class Shard:
    """A fixed block of the input, always run whole on an engine with nothing cached. llama.cpp's numbers
    for a sequence shift slightly with whatever shares its batch, which can flip a greedy token; fixing
    each job's batch-mates makes the output the same for any worker count, thread count or resume.
    Only the `wanted` results (those not in the output yet) are written."""

    jobs: tuple[Job, ...]
    wanted: frozenset[JobId]


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
        job_id, max_tokens = entry.get("id", n), entry_max_tokens(entry, f"{path} line {n}")
        if isinstance(job_id, dict | list):
            raise ValueError(f"{path} line {n}: 'id' must be a string or a number")
        if job_id in seen:
            raise ValueError(f"{path} line {n}: id {job_id!r} appears twice")
        seen.add(job_id)
        jobs.append(Job(job_id, entry["prompt"], max_tokens))
    return jobs


def output_line(job_id: Hashable, output: RequestOutput) -> str:
    record = request_record(output)
    out = {"id": job_id, **{k: record[k] for k in OUTPUT_FIELDS}}
    if record["error"] is not None:
        out["error"] = record["error"]
    return json.dumps(out, ensure_ascii=False)


def run_shard(engine: Engine, shard: Shard, out: IO[str], max_new: int,
              on_done: Callable[[], None] | None = None) -> int:
    """Generate a whole shard (greedy) on an idle engine with nothing cached, writing each wanted result as
    it finishes; returns how many were written."""
    assert not engine.has_work, "a shard needs the engine to itself"
    engine.drop_cached_prefixes()
    llm = LLM(engine, LLM.feed_window(engine))
    for job in shard.jobs:
        llm.push(Pending(job.id, job.prompt, SamplingParams(max_tokens=job.max_tokens or max_new)))
    written = 0
    for job_id, output in llm.run():
        if job_id not in shard.wanted:
            continue
        out.write(output_line(job_id, output) + "\n")
        out.flush()
        written += 1
        if on_done is not None:
            on_done()
    return written


def pending_shards(jobs: Sequence[Job], output: str | Path, max_slots: int) -> list[Shard]:
    """The input's shards (fixed blocks of SHARD_PER_SLOT * max_slots lines) that still miss results."""
    done = ResultsFile(Path(output)).finished_ids()
    size = SHARD_PER_SLOT * max_slots
    shards = []
    for start in range(0, len(jobs), size):
        block = tuple(jobs[start:start + size])
        wanted = frozenset(job.id for job in block if job.id not in done)
        if wanted:
            shards.append(Shard(block, wanted))
    return shards
