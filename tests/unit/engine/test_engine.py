"""Finishing, failing and aborting requests; sampling through per-request chains."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.outputs import RequestOutput
from cobali.engine.request import FinishReason, Request, RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM


def run_to_end(engine: Engine) -> list[RequestOutput]:
    """Every output the engine makes until it has no work left."""
    outputs: list[RequestOutput] = []
    while engine.has_work:
        outputs += engine.step()
    return outputs


def texts_by_request(outputs: list[RequestOutput]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for o in outputs:
        texts[o.request_id] = texts.get(o.request_id, "") + o.text
    return texts


def make_engine(slots: int = 2, n_ctx_seq: int = 4096, **backend_kw) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_ctx_seq=n_ctx_seq, **backend_kw)
    return Engine(backend, EngineConfig(max_slots=slots, prefill_chunk_tokens=64, n_batch=128))


def test_max_tokens_ends_with_length() -> None:
    (r,) = LLM(make_engine()).generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert (r.finish_reason, len(r.token_ids), r.n_tokens, r.finished) == (FinishReason.LENGTH, 5, 5, True)
    times = r.stats.token_times
    assert len(times) == 5 and r.stats.finish_time >= times[-1] >= r.stats.arrival_time


def test_eog_ends_with_stop_unless_ignored() -> None:
    engine = make_engine()
    prompts = [[1 + (i * 11) % 90 for i in range(n)] for n in range(1, 60)]
    runs = LLM(engine).generate(prompts, SamplingParams(max_tokens=40))
    stopped = [(p, r) for p, r in zip(prompts, runs, strict=True) if r.finish_reason is FinishReason.STOP]
    assert stopped, "the fake model emits EOG for some prompts"
    assert all(r.token_ids[-1] == EOG_TOKEN and r.stop_reason is None for _, r in stopped)
    again = LLM(engine).generate([stopped[0][0]], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert again.finish_reason is FinishReason.LENGTH and len(again.token_ids) == 40


def test_stop_string_ends_and_is_not_emitted() -> None:
    engine = make_engine()
    (free,) = LLM(engine).generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free.text[10:12]
    r = engine.add_request("abc", SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)), stream_interval=1)
    deltas = [o.text for o in run_to_end(engine)]
    cut = free.text.index(stop)
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == stop
    assert r.text == free.text[:cut] == "".join(deltas)


class VisibleEogBackend(FakeBackend):
    """Its end-of-generation token has a piece of text (as some models' do), which must never reach the output."""

    def token_bytes(self, token: int) -> bytes:
        return b"</s>" if token == EOG_TOKEN else super().token_bytes(token)


def test_text_made_at_the_end_matches_the_streamed_text() -> None:
    """Without a stream or stop strings the engine renders text once at the finish; it must be the text a
    stream gets, for every way a request can end (end-of-generation, length, abort)."""
    prompts = [[1 + (i * 11) % 90 for i in range(n)] for n in range(1, 30)]
    config = EngineConfig(max_slots=2, prefill_chunk_tokens=64, n_batch=128)
    for params in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=7, ignore_eos=True)):
        quiet, streamed = (Engine(VisibleEogBackend(n_seq_max=2), config) for _ in range(2))
        done = LLM(quiet).generate(prompts, params)
        live = [streamed.add_request(p, params, stream_interval=1) for p in prompts]
        deltas = texts_by_request(run_to_end(streamed))
        assert {r.finish_reason for r in done} == ({FinishReason.LENGTH} if params.ignore_eos else
                                                   {FinishReason.LENGTH, FinishReason.STOP})
        assert [r.text for r in done] == [r.text for r in live] == [deltas[r.id] for r in live]
    engine = make_engine()
    r = engine.add_request("abc", SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.abort(r.id)
    (out,) = run_to_end(engine)
    assert out.finish_reason is FinishReason.ABORT and len(out.text) == len(out.token_ids) == out.n_tokens > 0


def test_a_stream_interval_hands_text_over_every_n_tokens_and_loses_none() -> None:
    """The first text at once, then at least N tokens apart, and the end at once; the text decoded late is the
    text decoded token by token, for requests ending on end-of-generation (a visible piece) and on length."""
    prompts = [[1 + (i * 7) % 90 for i in range(n)] for n in range(1, 20)]
    config = EngineConfig(max_slots=4, prefill_chunk_tokens=64, n_batch=128)
    for params in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=23, ignore_eos=True)):
        reference = LLM(Engine(VisibleEogBackend(n_seq_max=4), config)).generate(prompts, params)
        engine = Engine(VisibleEogBackend(n_seq_max=4), config)
        live = [engine.add_request(p, params, stream_interval=5) for p in prompts]
        outputs = run_to_end(engine)
        assert [r.text for r in live] == [r.text for r in reference]
        for r in live:
            mine = [o for o in outputs if o.request_id == r.id]
            counts = [o.n_tokens for o in mine if not o.finished]
            assert "".join(o.text for o in mine) == r.text and mine[-1].finished
            assert [t for o in mine for t in o.token_ids] == r.output_tokens
            assert all(b - a >= 5 for a, b in itertools.pairwise(counts)), counts
            assert not counts or counts[0] == 1  # every token here has text: the first one is not held


def test_context_full_ends_with_length() -> None:
    (r,) = LLM(make_engine(n_ctx_seq=20)).generate([list(range(1, 16))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.finish_reason is FinishReason.LENGTH and r.n_prompt_tokens + len(r.token_ids) == 20


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "empty"), ([], "empty"), (list(range(1, 30)), "context holds 20"), ([1, 999], "token ids")],
)
def test_bad_prompts_fail_alone(prompt, message: str) -> None:
    engine = make_engine(n_ctx_seq=20)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt)
    bad, good = LLM(engine).generate([prompt, "ok"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert bad.finish_reason is FinishReason.ERROR and message in bad.error and bad.request_id < 0
    assert good.finish_reason is FinishReason.LENGTH


def test_failed_decode_fails_that_batch_only_and_engine_keeps_serving() -> None:
    engine = make_engine(fail_on_calls={1})
    a = engine.add_request("first", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    b_ = engine.add_request("second", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # decode call 1 fails: both requests were in that batch
    assert a.state is b_.state is RequestState.FAILED and "injected failure" in a.error
    assert engine._slots.n_free == 2, "failed requests give their slots back"
    (c,) = LLM(engine).generate(["third"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert c.finish_reason is FinishReason.LENGTH


def test_no_kv_slot_preempts_the_newest_and_outputs_are_unchanged() -> None:
    prompts = [list(range(1, 21)), list(range(2, 22))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = LLM(make_engine()).generate(prompts, params)
    engine = make_engine(fail_on_calls={2}, fail_code=1)
    runs = LLM(engine).generate(prompts, params)
    assert engine._scheduler.preemptions == 1
    assert [r.token_ids for r in runs] == [r.token_ids for r in clean]
    assert all(r.finish_reason is FinishReason.LENGTH for r in runs)
    assert [r.stats.preemptions for r in runs] == [0, 1], "the newest went back to the queue"


def test_no_kv_slot_for_a_lone_request_fails_it() -> None:
    engine = make_engine(fail_on_calls={0}, fail_code=1)
    (r,) = LLM(engine).generate(["alone"], SamplingParams(max_tokens=3))
    assert r.finish_reason is FinishReason.ERROR and "no KV slot" in r.error


def test_abort_frees_slot_and_kv_at_the_next_tick() -> None:
    engine = make_engine()
    r = engine.add_request("long one", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    slot = r.slot
    assert engine._backend.kv[slot]
    engine.abort(r.id)
    engine.step()
    assert r.finish_reason is FinishReason.ABORT and r.slot is None
    assert engine._backend.kv[slot] == [] and engine._slots.n_free == 2 and not engine.has_work


def test_aborting_a_queued_request_removes_it() -> None:
    engine = make_engine(slots=1)
    engine.add_request("a", SamplingParams(max_tokens=3))
    queued = engine.add_request("b", SamplingParams(max_tokens=3))
    engine.step()
    engine.abort(queued.id)
    list(LLM(engine).run())
    assert queued.finish_reason is FinishReason.ABORT and queued.output_tokens == []


def test_seeded_sampling_is_per_request_and_reproducible() -> None:
    params = SamplingParams(max_tokens=20, temperature=1.5, seed=7, ignore_eos=True)
    first = LLM(make_engine()).generate(["x", "x"], params)
    second = LLM(make_engine()).generate(["x"], params)
    assert first[0].token_ids == first[1].token_ids == second[0].token_ids
    greedy = LLM(make_engine()).generate(["x"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert greedy.token_ids != first[0].token_ids


def test_a_token_without_text_is_handed_over_as_it_comes() -> None:
    """An end-of-generation token under ignore_eos has no text; its stream still hears of it at once (an empty
    delta, as vLLM streams a chunk per token), so a client times its tokens as they come."""
    prompt = [1 + (i * 7 + 23) % 90 for i in range(8)]  # its second output token is the fake's end token
    engine = make_engine()
    request = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), stream_interval=1)
    outputs = run_to_end(engine)
    assert request.output_tokens[1] == EOG_TOKEN
    assert [(o.n_tokens, o.text) for o in outputs] == [(1, "Q"), (2, ""), (3, ">"), (4, "E"), (5, "^")]
    assert [o.token_ids for o in outputs] == [(t,) for t in request.output_tokens]


def test_stream_yields_the_final_text() -> None:
    engine = make_engine()
    text = "".join(LLM(engine).stream("hello", SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(text) == 8


@pytest.mark.parametrize(
    "kwargs",
    [{"max_tokens": 0}, {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0}, {"top_k": -1},
     {"min_p": 2}, {"repetition_penalty": 0}, {"seed": -1}, {"stop": ("",)}],
)
def test_bad_sampling_params_raise(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_illegal_state_transition_is_an_assertion() -> None:
    r = Request(0, [1], SamplingParams())
    r.finish(FinishReason.STOP, 0.0)
    with pytest.raises(AssertionError):
        r.transition(RequestState.DECODE)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="mode"):
        EngineConfig(mode="fast")
    with pytest.raises(ValueError, match="n_batch"):
        Engine(FakeBackend(n_seq_max=8), EngineConfig(max_slots=8, n_batch=4))


def test_a_failing_sampler_fails_only_its_request() -> None:
    engine = make_engine()

    def broken(params: SamplingParams):
        raise RuntimeError("sampler exploded")

    engine._backend.new_sampler = broken
    sampled = engine.add_request("x", SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True))
    greedy = engine.add_request("y", SamplingParams(max_tokens=3, ignore_eos=True))
    list(LLM(engine).run())
    assert sampled.state is RequestState.FAILED and "sampler exploded" in sampled.error
    assert greedy.finish_reason is FinishReason.LENGTH and len(greedy.output_tokens) == 3


def test_fake_sampler_survives_extreme_parameters() -> None:
    params = SamplingParams(max_tokens=5, temperature=1e-30, repetition_penalty=1e-30, top_p=1e-9, min_p=1.0,
                            ignore_eos=True, seed=1)
    (r,) = LLM(make_engine()).generate(["abc"], params)
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 5


def test_batch_rows_follow_slot_order() -> None:
    """llama.cpp splits a per-stream batch at every break in consecutive seq_ids, so rows go in slot order
    (the plan's chunks keep decode-first priority order)."""
    engine = make_engine(slots=4)
    seen: list[list[int]] = []
    decode = engine._backend.decode

    def recording_decode(tokens, positions, seq_ids, want_logits):
        seen.append(list(seq_ids))
        return decode(tokens, positions, seq_ids, want_logits)

    engine._backend.decode = recording_decode
    lengths = [3, 9, 2, 7, 5, 4, 8]
    for i, n in enumerate(lengths):
        engine.add_request(f"prompt number {i} " * (i + 1), SamplingParams(max_tokens=n, ignore_eos=True))
    mixed = False
    while engine.has_work:
        ticks = len(engine.ticks)
        engine.step()
        if len(engine.ticks) == ticks:
            continue
        record = engine.ticks[-1]
        kinds = [c.kind.value for c in record.plan.chunks]
        mixed |= "decode" in kinds and "prefill" in kinds and [c.slot for c in record.plan.rows] != [
            c.slot for c in record.plan.chunks]
        assert seen[-1] == sorted(seen[-1])
    assert mixed, "the scenario has a tick whose row order differs from its priority order"


def test_logprobs_are_the_model_distribution_and_sorted() -> None:
    engine = make_engine()
    captured: list[np.ndarray] = []
    decode = engine._backend.decode
    engine._backend.decode = lambda *a: captured.append(decode(*a).copy()) or captured[-1]
    (r,) = LLM(engine).generate(["logprob me"], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3))
    assert tuple(e.token for e in r.logprobs) == r.token_ids
    for entry, logits in zip(r.logprobs, captured, strict=True):
        expected = logits[-1] - np.log(np.exp(logits[-1] - logits[-1].max()).sum()) - logits[-1].max()
        assert entry.logprob == pytest.approx(expected[entry.token])
        assert [t for t, _ in entry.top] == list(np.argsort(-expected, kind="stable")[:3])
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob)), "greedy picks the likeliest"
    (plain,) = LLM(make_engine()).generate(["logprob me"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert plain.logprobs == () and plain.token_ids == r.token_ids
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
