"""Speculative decoding by prompt lookup (engine/spec.py) on the fake backend, whose logits depend only on a
sequence's KV and which raises on a row at the wrong position: guesses must never change greedy outputs, and
the cells of wrong guesses must leave the KV."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.outputs import RequestOutput
from cobali.engine.request import FinishReason, Request
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.speculative import NgramDrafter, SpecConfig
from cobali.faces.cli import main
from cobali.frontend.offline import LLM
from tests.unit.http.test_server_api import fake_app, wait_healthy

PROMPTS = ["abcabcabcabc", "hello hello hello", "xyzxyz", "the cat the cat the", "qwerty", "aaaaaaaa"]


def request_with(tokens: list[int], n_prompt: int | None = None) -> Request:
    n_prompt = len(tokens) if n_prompt is None else n_prompt
    request = Request(0, tokens[:n_prompt], SamplingParams(max_tokens=64))
    request.output_tokens = tokens[n_prompt:]
    return request


def test_lookup_takes_the_most_recent_match_of_the_longest_run() -> None:
    drafter = NgramDrafter(SpecConfig(3, prompt_lookup_min=2, prompt_lookup_max=3))
    # The last 3 tokens (7, 1, 2) occurred once, followed by 9 8; the last 2 (1, 2) more recently, followed by 5.
    tokens = [7, 1, 2, 9, 8, 1, 2, 5, 6, 7, 1, 2]
    assert drafter.propose(request_with(tokens), 3) == (9, 8, 1)
    assert drafter.propose(request_with(tokens), 1) == (9,)
    assert drafter.propose(request_with([4, 5, 6, 7]), 3) == ()
    assert NgramDrafter(SpecConfig(3, 2, 2)).propose(request_with([1, 2, 5, 1, 2, 6, 1, 2]), 3) == (6, 1, 2)
    assert drafter.propose(request_with(tokens), 0) == ()


def test_lookup_grows_its_index_with_the_outputs() -> None:
    drafter = NgramDrafter(SpecConfig(4, prompt_lookup_min=2, prompt_lookup_max=2))
    request = request_with([1, 2, 3, 4])
    assert drafter.propose(request, 4) == ()
    request.output_tokens += [9, 1, 2]  # (1, 2) now recurs: what followed it in the prompt is guessed
    assert drafter.propose(request, 4) == (3, 4, 9, 1)
    request.output_tokens += [3, 7, 3]  # (7, 3): new; no guess
    assert drafter.propose(request, 4) == ()
    drafter.forget(request.id)
    assert drafter.propose(request_with([5, 6, 5, 6]), 4) == (5, 6)  # a fresh index for the id


class Oracle:
    """Guesses each request's reference continuation, with one wrong token in every other guess."""

    def __init__(self, references: list[list[int]], max_batch: int = 16, n: int = 4) -> None:
        self.references, self.max_batch, self.n = references, max_batch, n
        self.calls = 0

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        done = len(request.output_tokens) - request.n_pending
        guess = list(self.references[request.id % len(self.references)][done:done + min(limit, self.n)])
        self.calls += 1
        if len(guess) >= 3 and self.calls % 2:
            guess[2] = (guess[2] + 1) % 96
        return tuple(guess)

    def forget(self, request_id: int) -> None:
        pass


NO_SPEC = SpecConfig()


def run(params: SamplingParams, spec: SpecConfig = NO_SPEC, drafter=None, slots: int = 4,
        backend: FakeBackend | None = None, prompts: list[str] = PROMPTS) -> tuple[list[RequestOutput], Engine]:
    engine = Engine(backend or FakeBackend(n_seq_max=slots), EngineConfig(max_slots=slots, spec=spec))
    if drafter is not None:
        engine._scheduler.drafter = drafter
    return LLM(engine).generate(prompts, params), engine


def reference(params: SamplingParams) -> list[RequestOutput]:
    return run(params)[0]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, ignore_eos=True),
    SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=40, ignore_eos=True, stop=("QR",)),
    SamplingParams(max_tokens=7, ignore_eos=True),
], ids=["greedy", "logprobs", "stop", "short"])
@pytest.mark.parametrize("device_argmax", [False, True])
def test_guesses_keep_greedy_outputs(params: SamplingParams, device_argmax: bool) -> None:
    ref = reference(params)
    oracle = Oracle([r.token_ids for r in ref])
    out, engine = run(params, SpecConfig(4), oracle, backend=FakeBackend(n_seq_max=4, device_argmax=device_argmax))
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    assert [r.text for r in out] == [r.text for r in ref]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in ref]
    assert [r.logprobs for r in out] == [r.logprobs for r in ref]
    assert 0 < engine._executor.n_accepted_tokens < engine._executor.n_draft_tokens  # right and wrong guesses both ran
    assert len(engine.ticks) < len(run(params)[1].ticks)


def test_a_request_that_ends_inside_its_guesses_leaves_only_its_tokens_in_kv() -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[0] * 4  # past the prefix cache's shortest reusable prefix
    (ref,), _ = run(params, prompts=[prompt])
    stop_id = ref.token_ids[5]  # ends request 0 inside a tick's guesses
    stopping = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop_id,))
    expected = run(stopping, prompts=[prompt])[0][0]
    backend = FakeBackend(n_seq_max=4)
    (out,), engine = run(stopping, SpecConfig(4), Oracle([ref.token_ids], n=8), backend=backend,
                         prompts=[prompt])
    assert out.token_ids == expected.token_ids and out.stop_reason == stop_id
    assert engine._executor.n_accepted_tokens > 0
    # The slot keeps the request's prefix for reuse: exactly its tokens but the last (never fed).
    (slot_kv,) = [kv for kv in backend.kv.values() if kv]
    assert slot_kv == (backend.tokenize(prompt) + list(out.token_ids))[:-1]
    # ... and a request sharing that prefix reuses it and still decodes greedily.
    again = LLM(engine).generate([prompt], stopping)[0]
    assert again.cached_tokens > 0 and again.token_ids == expected.token_ids


def test_only_greedy_requests_in_small_batches_guess() -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    refs = [r.token_ids for r in reference(params)]
    # Two requests decoding together: max_batch 1 guesses never, 2 does.
    _, engine = run(params, SpecConfig(4), Oracle(refs, max_batch=1), slots=2)
    assert engine._executor.n_draft_tokens == 0
    _, engine = run(params, SpecConfig(4), Oracle(refs, max_batch=2), slots=2)
    assert engine._executor.n_draft_tokens > 0
    for other in (SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=1),
                  SamplingParams(max_tokens=30, ignore_eos=True, min_tokens=5),
                  SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.3)):
        _, engine = run(other, SpecConfig(4), Oracle(refs))
        assert engine._executor.n_draft_tokens == 0


def test_guesses_fit_the_batch() -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    refs = [r.token_ids for r in reference(params)]
    backend = FakeBackend(n_seq_max=4, n_batch=6)  # 4 decode rows leave 2 for guesses
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=6, prefill_chunk_tokens=6, spec=SpecConfig(4)))
    engine._scheduler.drafter = Oracle(refs)
    out = LLM(engine).generate(PROMPTS, params)
    assert [r.token_ids for r in out] == refs
    assert max(len(b.tokens) for b in backend.batches) <= 6 and engine._executor.n_draft_tokens > 0


def test_no_guess_runs_past_max_tokens() -> None:
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    (ref,), _ = run(params, prompts=PROMPTS[:1], slots=1)
    backend = FakeBackend(n_seq_max=1)
    (out,), _ = run(params, SpecConfig(8), Oracle([list(ref.token_ids) + [5] * 20], n=8), slots=1, backend=backend,
                    prompts=PROMPTS[:1])
    assert out.token_ids == ref.token_ids
    # The last output is sampled, never fed: no row at position prompt + max_tokens - 1 or later.
    assert max(max(b.positions) for b in backend.batches) == out.n_prompt_tokens + 9 - 2


def test_no_guess_runs_past_the_context() -> None:
    """A KV stream of 40 cells, no whole number of blocks: the cells a request holds round up past the stream's
    end, and guesses there failed the decode (the request ended in an error; two, preempted each other forever)."""
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = PROMPTS[0] * 2  # 24 tokens: 16 outputs fill the context
    (ref,), _ = run(params, prompts=[prompt], slots=1, backend=FakeBackend(n_seq_max=1, n_ctx_seq=40))
    assert ref.finish_reason is FinishReason.LENGTH and len(ref.token_ids) == 16
    backend = FakeBackend(n_seq_max=1, n_ctx_seq=40)
    (out,), engine = run(params, SpecConfig(8), Oracle([list(ref.token_ids) + [5] * 20], n=8), slots=1,
                         backend=backend, prompts=[prompt])
    assert (out.token_ids, out.finish_reason) == (ref.token_ids, FinishReason.LENGTH)
    assert engine._executor.n_accepted_tokens > 0
    assert max(max(b.positions) for b in backend.batches) == 40 - 2  # the last output is sampled, never fed


def lookup_friendly_prompt(params: SamplingParams) -> tuple[list[int], tuple[int, ...]]:
    """The fake's greedy outputs rarely repeat, so the prompt carries them: its logits depend on the last three
    tokens and on the length modulo the vocabulary (96), so 96 tokens put in front change no greedy token, and
    those 96 begin with the outputs, where the drafter then finds them. Returns the prompt and its outputs."""
    prompt = FakeBackend().tokenize("the cat sat on the mat")
    (ref,), _ = run(params, prompts=[prompt], slots=1)
    front = (list(ref.token_ids) + [1] * 96)[:96]
    (alone,), _ = run(params, prompts=[front + prompt], slots=1)
    assert alone.token_ids == ref.token_ids  # the premise
    return front + prompt, ref.token_ids


def test_prompt_lookup_end_to_end() -> None:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt, expected = lookup_friendly_prompt(params)
    (out,), engine = run(params, SpecConfig(3), prompts=[prompt], slots=1)
    assert out.token_ids == expected
    assert engine._executor.n_accepted_tokens > len(expected) // 2


def test_the_server_counts_guesses_in_its_metrics() -> None:
    prompt, _ = lookup_friendly_prompt(SamplingParams(max_tokens=24, ignore_eos=True))
    texts, kept = [], []
    for spec in (SpecConfig(), SpecConfig(3)):
        engine = lambda spec=spec: Engine(FakeBackend(n_seq_max=1), EngineConfig(max_slots=1, spec=spec))  # noqa: E731
        with TestClient(fake_app(engine, "m")) as client:
            wait_healthy(client)
            body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                        "ignore_eos": True}).json()
            texts.append(body["choices"][0]["text"])
            metrics = client.get("/metrics").text
            drafted = float(re.search(r"^cobali:spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M)[1])
            kept.append(float(re.search(r"^cobali:spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M)[1]))
            assert kept[-1] <= drafted
    assert texts[0] == texts[1] and kept[0] == 0 < kept[1]


@pytest.mark.parametrize("kwargs, message", [
    ({"spec": SpecConfig(2), "async_scheduling": True}, "async scheduling"),
])
def test_config_refuses_what_cannot_work(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"),
    ({"max_batch": 0}, "max_batch"),
])
def test_spec_config_checks_its_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpecConfig(**kwargs)


@pytest.mark.parametrize("flags, message", [
    (["--num-speculative-tokens", "2", "--async-scheduling"], "async scheduling"),
    (["--num-speculative-tokens", "-2"], "-2"),
    (["--num-speculative-tokens", "2", "--prompt-lookup-min", "5"], "prompt_lookup_min"),
])
def test_cli_names_the_bad_value(flags: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--prompts", "workloads/prompts_16.txt", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_finish_reasons_match_with_end_tokens() -> None:
    params = SamplingParams(max_tokens=40)  # end tokens end requests, perhaps inside a tick's guesses
    ref = reference(params)
    out, _ = run(params, SpecConfig(4), Oracle([r.token_ids for r in ref]))
    assert [(r.token_ids, r.finish_reason) for r in out] == [(r.token_ids, r.finish_reason) for r in ref]
    assert any(r.finish_reason is FinishReason.STOP for r in ref)


def test_an_engine_refuses_more_guesses_than_its_backend_reads_per_sequence() -> None:
    backend = FakeBackend(n_seq_max=1)
    backend.info = replace(backend.info, max_outputs_per_seq=3)
    Engine(backend, EngineConfig(max_slots=1, spec=SpecConfig(2)))
    with pytest.raises(ValueError, match="3 speculative tokens need 4 outputs per sequence, the backend takes 3"):
        Engine(backend, EngineConfig(max_slots=1, spec=SpecConfig(3)))


class VaryingOracle(Oracle):
    """Guesses 1 to 4 tokens, by request."""

    def propose(self, request: Request, limit: int) -> tuple[int, ...]:
        return super().propose(request, min(limit, 1 + request.id % 4))


@pytest.mark.parametrize("kv_unified", [False, True])
def test_per_sequence_streams_get_guesses_of_one_length(kv_unified: bool) -> None:
    """llama.cpp splits a batch over per-sequence KV streams into micro-batches that take as many rows from
    each sequence: guesses of different lengths would cost a forward pass each. A unified KV has no such split."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = reference(params)
    backend = FakeBackend(n_seq_max=4, kv_unified=kv_unified, n_ctx_seq=4096 if not kv_unified else 16384)
    out, engine = run(params, SpecConfig(4), VaryingOracle([r.token_ids for r in ref]), backend=backend)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    lengths = [{len(d) for d in t.plan.drafts.values()} for t in engine.ticks if t.plan.drafts]
    assert lengths and (max(map(len, lengths)) == 1) is not kv_unified
