"""The tick's three calls (schedule, execute, update_from_output) and what crosses between them: a plan committed
as it is made, a StepResult the executor made without touching the requests, and outputs as messages."""

from __future__ import annotations

import copy

import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.outputs import RequestOutput
from cobali.engine.request import PENDING_TOKEN, Request
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

PROMPTS = [[1 + (i * 7 + s) % 90 for i in range(n)] for s, n in enumerate((5, 40, 12, 70))]
PARAMS = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=2)


def make_engine(**config) -> Engine:
    return Engine(FakeBackend(n_seq_max=4, n_batch=64), EngineConfig(max_slots=4, n_batch=64, prefill_chunk_tokens=16,
                                                                     **config))


def test_the_three_calls_are_the_tick() -> None:
    expected = LLM(make_engine()).generate(PROMPTS, PARAMS)
    engine = make_engine()
    for prompt in PROMPTS:
        engine.add_request(prompt, PARAMS)
    outputs: list[RequestOutput] = []
    while engine.has_work:
        plan = engine.schedule()
        outputs += engine.update_from_output(plan, engine.execute(plan))
    untimed = [o._replace(stats=o.stats and o.stats.n_output_tokens) for o in expected]
    in_order = sorted(outputs, key=lambda o: o.request_id)
    assert [o._replace(stats=o.stats and o.stats.n_output_tokens) for o in in_order] == untimed


def test_a_plan_is_committed_as_it_is_made() -> None:
    """Each request counts its planned rows in its KV, and a stand-in for the token they sample: the next plan
    can be made before this one runs."""
    engine = make_engine()
    request = engine.add_request(PROMPTS[1], PARAMS)
    plan = engine.schedule()
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.n_tokens, chunk.yields_token) == (0, 16, False)
    assert request.computed_tokens == 16 and request.output_tokens == []
    engine.update_from_output(plan, engine.execute(plan))
    plan = engine.schedule()
    while not plan.chunks[0].yields_token:
        engine.update_from_output(plan, engine.execute(plan))
        plan = engine.schedule()
    assert request.computed_tokens == len(PROMPTS[1]) and request.output_tokens == [PENDING_TOKEN]
    engine.update_from_output(plan, engine.execute(plan))
    assert request.n_pending == 0 and request.output_tokens[0] != PENDING_TOKEN


def snapshot(request: Request) -> dict:
    """Everything a request holds but its text stream (compared by identity)."""
    return copy.deepcopy({k: v for k, v in vars(request).items() if k != "stream"})


def test_the_executor_changes_no_request() -> None:
    engine = make_engine()
    requests = [engine.add_request(p, PARAMS) for p in PROMPTS]
    for _ in range(6):
        plan = engine.schedule()
        before = [snapshot(r) for r in requests]
        result = engine.execute(plan)
        assert [snapshot(r) for r in requests] == before, "the executor read the requests and changed one"
        engine.update_from_output(plan, result)
    assert result.requests and len(result.tokens) == len(result.requests)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_sink_takes_the_outputs_as_they_are_made(async_scheduling: bool) -> None:
    engine = make_engine(async_scheduling=async_scheduling)
    taken: list[RequestOutput] = []
    engine.on_outputs = taken.extend
    requests = [engine.add_request(p, PARAMS, stream_interval=3) for p in PROMPTS]
    while engine.has_work:
        assert engine.step() == []
    for request in requests:
        mine = [o for o in taken if o.request_id == request.id]
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        assert [t for o in mine for t in o.token_ids] == request.output_tokens
        assert [lp for o in mine for lp in o.logprobs] == request.logprobs
        assert "".join(o.text for o in mine) == request.text
        assert mine[-1].stats.n_output_tokens == PARAMS.max_tokens and mine[-1].stats.preemptions == 0
