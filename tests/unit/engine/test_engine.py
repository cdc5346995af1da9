"""Finishing, failing and aborting requests; sampling through per-request chains."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cobali.backends.base import SamplingParams
from cobali.backends.fake import EOG_TOKEN, FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason, Request, RequestState


def make_engine(slots: int = 2, n_ctx_seq: int = 4096, **backend_kw) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_ctx_seq=n_ctx_seq, **backend_kw)
    return Engine(backend, EngineConfig(max_slots=slots, prefill_chunk_tokens=64, n_batch=128))


def test_max_tokens_ends_with_length() -> None:
    (r,) = make_engine().generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert (r.finish_reason, len(r.output_tokens), r.state) == (FinishReason.LENGTH, 5, RequestState.DONE)
    assert len(r.token_times) == 5 and r.finish_time >= r.token_times[-1] >= r.arrival_time


def test_eog_ends_with_stop_unless_ignored() -> None:
    engine = make_engine()
    prompts = [[1 + (i * 11) % 90 for i in range(n)] for n in range(1, 60)]
    runs = engine.generate(prompts, SamplingParams(max_tokens=40))
    stopped = [r for r in runs if r.finish_reason is FinishReason.STOP]
    assert stopped, "the fake model emits EOG for some prompts"
    assert all(r.output_tokens[-1] == EOG_TOKEN for r in stopped)
    again = engine.generate([stopped[0].prompt_tokens], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert again.finish_reason is FinishReason.LENGTH and len(again.output_tokens) == 40


def test_stop_string_ends_and_is_not_emitted() -> None:
    engine = make_engine()
    (free,) = engine.generate(["abc"], SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free.text[10:12]
    deltas: list[str] = []
    r = engine.add_request("abc", SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)),
                           on_token=lambda _r, d, _n: deltas.append(d))
    engine.run_until_done()
    cut = free.text.index(stop)
    assert r.finish_reason is FinishReason.STOP
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
        deltas: dict[int, list[str]] = {}
        done = quiet.generate(prompts, params)
        keep = lambda r, d, _n, into=deltas: into.setdefault(r.id, []).append(d)  # noqa: E731
        live = [streamed.add_request(p, params, on_token=keep) for p in prompts]
        streamed.run_until_done()
        assert {r.finish_reason for r in done} == ({FinishReason.LENGTH} if params.ignore_eos else
                                                   {FinishReason.LENGTH, FinishReason.STOP})
        assert [r.text for r in done] == [r.text for r in live] == ["".join(deltas[r.id]) for r in live]
    engine = make_engine()
    r = engine.add_request("abc", SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.abort(r.id)
    engine.run_until_done()
    assert r.finish_reason is FinishReason.ABORT and len(r.text) == len(r.output_tokens) > 0


def test_a_stream_interval_hands_text_over_every_n_tokens_and_loses_none() -> None:
    """The first text at once, then at least N tokens apart, and the end at once; the text decoded late is the
    text decoded token by token, for requests ending on end-of-generation (a visible piece) and on length."""
    prompts = [[1 + (i * 7) % 90 for i in range(n)] for n in range(1, 20)]
    config = EngineConfig(max_slots=4, prefill_chunk_tokens=64, n_batch=128)
    for params in (SamplingParams(max_tokens=40), SamplingParams(max_tokens=23, ignore_eos=True)):
        reference = Engine(VisibleEogBackend(n_seq_max=4), config).generate(prompts, params)
        engine = Engine(VisibleEogBackend(n_seq_max=4), config)
        calls: dict[int, list[tuple[int, str, bool]]] = {}
        keep = lambda r, d, n, into=calls: into.setdefault(r.id, []).append((n, d, r.is_finished))  # noqa: E731
        live = [engine.add_request(p, params, on_token=keep, stream_interval=5) for p in prompts]
        engine.run_until_done()
        assert [r.text for r in live] == [r.text for r in reference]
        for r in live:
            counts = [n for n, _, finished in calls[r.id] if not finished]
            assert "".join(d for _, d, _ in calls[r.id]) == r.text and calls[r.id][-1][2]
            assert all(b - a >= 5 for a, b in itertools.pairwise(counts)), counts
            assert not counts or counts[0] == 1  # every token here has text: the first one is not held


def test_context_full_ends_with_length() -> None:
    (r,) = make_engine(n_ctx_seq=20).generate([list(range(1, 16))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert r.finish_reason is FinishReason.LENGTH and len(r.prompt_tokens) + len(r.output_tokens) == 20


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "empty"), ([], "empty"), (list(range(1, 30)), "context holds 20"), ([1, 999], "token ids")],
)
def test_bad_prompts_fail_alone(prompt, message: str) -> None:
    engine = make_engine(n_ctx_seq=20)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt)
    bad, good = engine.generate([prompt, "ok"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert bad.state is RequestState.FAILED and message in bad.error
    assert good.finish_reason is FinishReason.LENGTH


def test_failed_decode_fails_that_batch_only_and_engine_keeps_serving() -> None:
    engine = make_engine(fail_on_calls={1})
    a = engine.add_request("first", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    b_ = engine.add_request("second", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # decode call 1 fails: both requests were in that batch
    assert a.state is b_.state is RequestState.FAILED and "injected failure" in a.error
    assert engine.slots.n_free == 2, "failed requests give their slots back"
    (c,) = engine.generate(["third"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert c.finish_reason is FinishReason.LENGTH


def test_no_kv_slot_preempts_the_newest_and_outputs_are_unchanged() -> None:
    prompts = [list(range(1, 21)), list(range(2, 22))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = make_engine().generate(prompts, params)
    engine = make_engine(fail_on_calls={2}, fail_code=1)
    runs = engine.generate(prompts, params)
    assert engine.scheduler.preemptions == 1
    assert [r.output_tokens for r in runs] == [r.output_tokens for r in clean]
    assert all(r.finish_reason is FinishReason.LENGTH for r in runs)


def test_no_kv_slot_for_a_lone_request_fails_it() -> None:
    engine = make_engine(fail_on_calls={0}, fail_code=1)
    (r,) = engine.generate(["alone"], SamplingParams(max_tokens=3))
    assert r.state is RequestState.FAILED and "no KV slot" in r.error


def test_abort_frees_slot_and_kv_at_the_next_tick() -> None:
    engine = make_engine()
    r = engine.add_request("long one", SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    slot = r.slot
    assert engine.backend.kv[slot]
    engine.abort(r.id)
    engine.step()
    assert r.finish_reason is FinishReason.ABORT and r.slot is None
    assert engine.backend.kv[slot] == [] and engine.slots.n_free == 2 and not engine.has_work


def test_aborting_a_queued_request_removes_it() -> None:
    engine = make_engine(slots=1)
    engine.add_request("a", SamplingParams(max_tokens=3))
    queued = engine.add_request("b", SamplingParams(max_tokens=3))
    engine.step()
    engine.abort(queued.id)
    engine.run_until_done()
    assert queued.finish_reason is FinishReason.ABORT and queued.output_tokens == []


def test_seeded_sampling_is_per_request_and_reproducible() -> None:
    params = SamplingParams(max_tokens=20, temperature=1.5, seed=7, ignore_eos=True)
    first = make_engine().generate(["x", "x"], params)
    second = make_engine().generate(["x"], params)
    assert first[0].output_tokens == first[1].output_tokens == second[0].output_tokens
    greedy = make_engine().generate(["x"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert greedy.output_tokens != first[0].output_tokens


def test_a_token_without_text_is_handed_over_as_it_comes() -> None:
    """An end-of-generation token under ignore_eos has no text; its stream still hears of it at once (an empty
    delta, as vLLM streams a chunk per token), so a client times its tokens as they come."""
    prompt = [1 + (i * 7 + 23) % 90 for i in range(8)]  # its second output token is the fake's end token
    engine = make_engine()
    calls: list[tuple[int, str]] = []
    request = engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True),
                                 on_token=lambda _r, delta, n: calls.append((n, delta)))
    engine.run_until_done()
    assert request.output_tokens[1] == EOG_TOKEN
    assert calls == [(1, "Q"), (2, ""), (3, ">"), (4, "E"), (5, "^")]


def test_stream_yields_the_final_text() -> None:
    engine = make_engine()
    text = "".join(engine.stream("hello", SamplingParams(max_tokens=8, ignore_eos=True)))
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

    engine.backend.new_sampler = broken
    sampled = engine.add_request("x", SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True))
    greedy = engine.add_request("y", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.run_until_done()
    assert sampled.state is RequestState.FAILED and "sampler exploded" in sampled.error
    assert greedy.finish_reason is FinishReason.LENGTH and len(greedy.output_tokens) == 3


def test_fake_sampler_survives_extreme_parameters() -> None:
    params = SamplingParams(max_tokens=5, temperature=1e-30, repetition_penalty=1e-30, top_p=1e-9, min_p=1.0,
                            ignore_eos=True, seed=1)
    (r,) = make_engine().generate(["abc"], params)
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_tokens) == 5


def test_batch_rows_follow_slot_order() -> None:
    """llama.cpp splits a per-stream batch at every break in consecutive seq_ids, so rows go in slot order
    (the plan's chunks keep decode-first priority order)."""
    engine = make_engine(slots=4)
    seen: list[list[int]] = []
    decode = engine.backend.decode

    def recording_decode(tokens, positions, seq_ids, want_logits):
        seen.append(list(seq_ids))
        return decode(tokens, positions, seq_ids, want_logits)

    engine.backend.decode = recording_decode
    lengths = [3, 9, 2, 7, 5, 4, 8]
    for i, n in enumerate(lengths):
        engine.add_request(f"prompt number {i} " * (i + 1), SamplingParams(max_tokens=n, ignore_eos=True))
    mixed = False
    while engine.has_work:
        record = engine.step()
        if record is None:
            continue
        kinds = [c.kind.value for c in record.plan.chunks]
        mixed |= "decode" in kinds and "prefill" in kinds and [c.slot for c in record.plan.rows] != [
            c.slot for c in record.plan.chunks]
        assert seen[-1] == sorted(seen[-1])
    assert mixed, "the scenario has a tick whose row order differs from its priority order"


def test_logprobs_are_the_model_distribution_and_sorted() -> None:
    engine = make_engine()
    captured: list[np.ndarray] = []
    decode = engine.backend.decode
    engine.backend.decode = lambda *a: captured.append(decode(*a).copy()) or captured[-1]
    (r,) = engine.generate(["logprob me"], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3))
    assert [e.token for e in r.logprobs] == r.output_tokens
    for entry, logits in zip(r.logprobs, captured, strict=True):
        expected = logits[-1] - np.log(np.exp(logits[-1] - logits[-1].max()).sum()) - logits[-1].max()
        assert entry.logprob == pytest.approx(expected[entry.token])
        assert [t for t, _ in entry.top] == list(np.argsort(-expected, kind="stable")[:3])
        assert entry.top[0] == (entry.token, pytest.approx(entry.logprob)), "greedy picks the likeliest"
    (plain,) = make_engine().generate(["logprob me"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert plain.logprobs == [] and plain.output_tokens == r.output_tokens
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
