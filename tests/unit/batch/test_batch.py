"""Offline batch jobs on the fake backend: the driver, JSONL in and out, resuming after a kill."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from cobali.backends.fake import FakeBackend
from cobali.batch.jobs import Job, Shard, pending_shards, read_jobs, run_shard
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.faces.cli import main
from cobali.frontend.offline import LLM, Pending
from cobali.harness.results_file import ResultsFile

PROMPTS = [f"prompt {i}: " + "abcdefghij"[: 1 + i % 10] * (1 + i % 4) for i in range(12)]


def make_engine(n_ctx_seq: int = 4096) -> Engine:
    return Engine(FakeBackend(n_seq_max=3, n_ctx_seq=n_ctx_seq), EngineConfig(max_slots=3, n_batch=64,
                                                                                prefill_chunk_tokens=16))


def write_input(path: Path, with_ids: bool = True) -> Path:
    lines = [{"id": f"q{i}", "prompt": p} if with_ids else {"prompt": p} for i, p in enumerate(PROMPTS)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_a_fed_stream_reports_every_request_once_with_a_short_queue() -> None:
    engine = make_engine(n_ctx_seq=40)
    llm = LLM(engine, window=2)
    for i in range(200):
        prompt = "x" * 50 if i == 7 else f"p{i}"  # request 7 is longer than the context
        llm.push(Pending(i, prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    done = []
    while llm.has_work:
        done += llm.step()
        assert len(engine._scheduler.waiting) <= 2
    keys = [k for k, _ in done]
    assert sorted(keys) == list(range(200))
    assert dict(done)[7].error and all(len(r.token_ids) == 3 for k, r in done if k != 7)


def plans(engine: Engine) -> list[tuple[tuple[int, int, int, int], ...]]:
    return [tuple((c.request_id, c.slot, c.start, c.n_tokens) for c in t.plan.chunks) for t in engine.ticks]


def run_all(engine: Engine, shards: list[Shard], out: io.StringIO | io.TextIOBase) -> int:
    return sum(run_shard(engine, shard, out, max_new=12) for shard in shards)


def test_jobs_match_generate(tmp_path: Path) -> None:
    jobs = read_jobs(write_input(tmp_path / "in.jsonl"))
    out = io.StringIO()
    shards = pending_shards(jobs, tmp_path / "none.jsonl", max_slots=1)
    assert [len(s.jobs) for s in shards] == [4, 4, 4]
    assert run_all(make_engine(), shards, out) == len(PROMPTS)
    records = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    expected = LLM(make_engine()).generate(PROMPTS, SamplingParams(max_tokens=12))
    for job, request in zip(jobs, expected, strict=True):
        record = records[job.id]
        assert record["text"] == request.text and record["output_tokens"] == len(request.token_ids)
        assert record["finish_reason"] == request.finish_reason.value
        assert set(record) == {"id", "text", "finish_reason", "prompt_tokens", "output_tokens"}


def test_resume_after_a_kill_reruns_the_shard_whole(tmp_path: Path) -> None:
    """The resumed shard runs exactly the batches of the first run (so llama.cpp computes the same
    numbers) and writes only what was missing."""
    jobs = read_jobs(write_input(tmp_path / "in.jsonl"))
    full, first = tmp_path / "full.jsonl", make_engine()
    with full.open("w") as f:
        run_all(first, pending_shards(jobs, full, max_slots=3), f)
    lines = full.read_text().splitlines(keepends=True)
    # killed after 5 results, in the middle of writing the 6th
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(lines[:5]) + lines[5][:10])
    shards = pending_shards(jobs, resumed, max_slots=3)
    assert len(shards) == 1 and len(shards[0].jobs) == 12 and len(shards[0].wanted) == 7
    ResultsFile(resumed).drop_unfinished()  # what `cobali batch` does before it appends
    assert resumed.read_text() == "".join(lines[:5])
    second = make_engine()
    with resumed.open("a") as f:
        assert run_all(second, shards, f) == 7
    assert sorted(resumed.read_text().splitlines()) == sorted(full.read_text().splitlines())
    assert plans(second) == plans(first)
    assert pending_shards(jobs, resumed, max_slots=3) == []


def test_a_shard_runs_as_on_a_fresh_engine(tmp_path: Path) -> None:
    """Prefixes cached by one shard are dropped before the next, so a shard's batches never depend on
    which worker ran what before it."""
    shared = "a long shared system prompt, " * 4
    jobs = [Job(i, shared + f"question {i}") for i in range(8)]
    shards = pending_shards(jobs, tmp_path / "none.jsonl", max_slots=1)
    worker, fresh = make_engine(), make_engine()
    run_all(worker, shards, io.StringIO())
    run_all(fresh, shards[1:], io.StringIO())
    second_on_worker = [[c[1:] for c in plan] for plan in plans(worker)[-len(fresh.ticks):]]
    assert second_on_worker == [[c[1:] for c in plan] for plan in plans(fresh)]


def test_ids_default_to_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "max_tokens": 3}\n')
    assert read_jobs(path) == [Job(1, "a"), Job(3, "b", 3)]
    assert ResultsFile(tmp_path / "missing.jsonl").finished_ids() == set()


@pytest.mark.parametrize(("text", "message"), [
    ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "appears twice"),
    ('{"prompt": 3}\n', "string 'prompt'"),
    ("not json\n", "not JSON"),
    ('{"prompt": "a", "max_tokens": 0}\n', "max_tokens"),
])
def test_bad_input_is_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_jobs(path)


@pytest.mark.parametrize(("text", "message"), [
    ('{"custom_id": "a", "response": {}}\n', "out.jsonl line 1: no 'id': not a results file"),
    ('{"id": "q0"}\n{"id": \n{"id": "q2"}\n', "out.jsonl line 2: not JSON"),
])
def test_an_output_that_is_not_batchs_is_an_error_naming_its_line(tmp_path: Path, text: str, message: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["batch", "--input", str(write_input(tmp_path / "in.jsonl")), "--output", str(output)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert output.read_text() == text


def test_a_resume_keeps_the_results_and_drops_the_cut_line(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')
    results = ResultsFile(output)
    assert results.finished_ids() == {"a", "b"}
    results.append("batch", "prompts", 3, 1, lambda out, on_done: out.write('{"id": "c"}\n') and 1)
    assert output.read_text() == '{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n'
    assert capsys.readouterr().out.splitlines() == [f"cobali batch: 3 prompts, 2 already in {output}, 1 to run",
                                                    f"wrote 1 results to {output}"]
