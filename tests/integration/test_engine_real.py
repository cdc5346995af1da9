"""The engine on the real embedded model: continuous batching must not change greedy outputs beyond
floating-point noise (divergences only at near-ties, judged by cobali.harness.fidelity)."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import MoveSlot
from cobali.engine.request import FinishReason
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.speculative import SpecConfig
from cobali.frontend.offline import LLM
from cobali.harness.fidelity import Trace, compare_runs, greedy_traces
from cobali.harness.workloads import WorkItem

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea and the wind that moves across it at night.",
    "def fibonacci(n):",
    "List three uses of a paperclip. First,",
    "Explain in one sentence why the sky is blue. The sky looks blue because",
    "Translate to French: Good morning, how are you today?",
    "Once upon a time in a small village at the edge of a great forest, there lived an old woodcutter who",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def backend(model_path: str):
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=256))
    yield backend
    backend.close()


def traces(backend, mode: str, **kw) -> list[Trace]:
    config = EngineConfig(mode=mode, max_slots=4, n_batch=256, **kw)
    return greedy_traces(Engine(backend, config), [WorkItem(p) for p in PROMPTS], 16)


@pytest.fixture(scope="module")
def seq_traces(backend) -> list[Trace]:
    return traces(backend, "seq")


def test_seq_answers_sensibly(backend) -> None:
    (r,) = LLM(Engine(backend, EngineConfig(mode="seq", max_slots=4, n_batch=256))).generate(
        PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True))
    assert r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 16
    assert "Paris" in r.text


def test_speculation_matches_seq_up_to_near_ties(backend, seq_traces) -> None:
    """Prompt lookup on the real model: guessed rows are scored in one pass with the decode row, so their
    numbers differ slightly from one row at a time; the kept tokens must still be greedy up to near-ties."""
    engine = Engine(backend, EngineConfig(mode="seq", max_slots=4, n_batch=256, spec=SpecConfig(3)))
    report = compare_runs(seq_traces, greedy_traces(engine, [WorkItem(p) for p in PROMPTS], 16))
    assert engine.stats().accepted_draft_tokens > 0  # the counting prompt repeats itself
    assert report.passed and report.mostly_common, report.describe()


# Chunk 64 is the setting (no prompt here is longer); chunk 8 splits every prompt mid-way.
@pytest.mark.parametrize("chunk", [64, 8])
def test_cont_matches_seq_up_to_near_ties(backend, seq_traces, chunk: int) -> None:
    report = compare_runs(seq_traces, traces(backend, "cont", prefill_chunk_tokens=chunk))
    assert report.passed and report.mostly_common, report.describe()


def test_async_scheduling_matches_seq_up_to_near_ties(backend, seq_traces) -> None:
    """llama_decode on its own thread while the next batch is planned: outputs as without overlap."""
    report = compare_runs(seq_traces, traces(backend, "cont", prefill_chunk_tokens=8, async_scheduling=True))
    assert report.passed and report.mostly_common, report.describe()


def test_requests_moved_into_slot_gaps_match_seq_up_to_near_ties(backend) -> None:
    """The request in slot 1 ends first, then the one in slot 3 (moved into 1): each move copies a request's KV
    to another llama.cpp stream, and it goes on from there."""
    items = [WorkItem(p, n) for p, n in zip(PROMPTS[:4], [16, 4, 10, 6], strict=True)]
    reference = greedy_traces(Engine(backend, EngineConfig(mode="seq", max_slots=4, n_batch=256)), items, 16)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    report = compare_runs(reference, greedy_traces(engine, items, 16))
    moves = [op for t in engine.ticks for op in t.plan.kv_ops if isinstance(op, MoveSlot)]
    assert moves == [MoveSlot(source=3, slot=1), MoveSlot(source=2, slot=1)]
    assert report.passed and report.mostly_common, report.describe()


def test_a_prefix_moved_out_of_a_gap_is_reused_up_to_near_ties(backend) -> None:
    """The request in slot 1 ends first and leaves its KV there; closing the gap moves that KV to slot 3 before
    the request in slot 2 moves in. Sent again, the prompt prefills only its last token, from the moved KV."""
    prompt = PROMPTS[6]
    items = [WorkItem(PROMPTS[1], 16), WorkItem(prompt, 4), WorkItem(PROMPTS[4], 10)]
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    greedy_traces(engine, items, 16)
    moves = [op for t in engine.ticks for op in t.plan.kv_ops if isinstance(op, MoveSlot)]
    assert moves == [MoveSlot(source=1, slot=3), MoveSlot(source=2, slot=1)]
    hits = engine._slots.hit_tokens
    again = greedy_traces(engine, [WorkItem(prompt, 12)], 16)
    assert engine._slots.hit_tokens - hits == len(backend.tokenize(prompt)) - 1
    reference = greedy_traces(Engine(backend, EngineConfig(mode="seq", max_slots=4, n_batch=256,
                                                           prefix_cache=False)), [WorkItem(prompt, 12)], 16)
    report = compare_runs(reference, again)
    assert report.passed and report.mostly_common, report.describe()


def test_a_sequence_restored_from_host_memory_into_another_stream_gives_the_same_logits(backend) -> None:
    tokens = np.array(backend.tokenize(PROMPTS[6]), dtype=np.int32)
    n = len(tokens)
    for seq in (0, 2):
        backend.remove_seq(seq)  # what earlier engines on this backend left there
    backend.decode(tokens, np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int8))
    data = backend.save_seq(0)
    assert abs(data.nbytes - n * backend.info.kv_bytes_per_token) < 1024, "the estimate sizes the host tier"
    backend.load_seq(2, data)
    one = np.ones(1, dtype=np.int8)
    logits = [backend.decode(tokens[-1:], np.array([n], dtype=np.int32), np.array([seq], dtype=np.int32), one).copy()
              for seq in (0, 2)]
    for seq in (0, 2):
        backend.remove_seq(seq)
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prompt_restored_from_host_memory_matches_seq_up_to_near_ties(backend, async_scheduling: bool) -> None:
    """Two slots: the prompt's KV leaves its slot for the two after it, to host memory, and comes back from there."""
    prompt = PROMPTS[6]
    engine = Engine(backend, EngineConfig(max_slots=2, n_batch=256, async_scheduling=async_scheduling))
    for text in (prompt, PROMPTS[1], PROMPTS[4]):
        greedy_traces(engine, [WorkItem(text, 4)], 16)
    again = greedy_traces(engine, [WorkItem(prompt, 12)], 16)
    assert engine._slots.host.hit_tokens == len(backend.tokenize(prompt)) - 1
    reference = greedy_traces(Engine(backend, EngineConfig(mode="seq", max_slots=4, n_batch=256,
                                                           prefix_cache=False)), [WorkItem(prompt, 12)], 16)
    report = compare_runs(reference, again)
    assert report.passed and report.mostly_common, report.describe()


def test_sampling_chain_with_seed_is_reproducible(backend) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, min_p=0.05,
                            repetition_penalty=1.1, seed=3, ignore_eos=True)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    a, b = LLM(engine).generate([PROMPTS[1], PROMPTS[1]], params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12


def test_chat_template_and_stop_string(backend) -> None:
    prompt = backend.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer briefly."}])
    assert prompt.startswith("<|im_start|>")
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
    (r,) = LLM(engine).generate([prompt], SamplingParams(max_tokens=40, stop=("4",)))
    assert r.finish_reason is FinishReason.STOP and "4" not in r.text


class PlantedBug:
    """The real backend with one bug planted: `wrong-row` hands the sampler the next request's logits (the
    first two output rows swapped); `wrong-kv` stores shifted token ids for every row of seq_id 1, as a bad
    prefix copy or stale KV would."""

    def __init__(self, inner: LlamaCppBackend, bug: str) -> None:
        self.inner, self.bug = inner, bug
        self.info = inner.info

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, tokens, positions, seq_ids, want_logits):
        if self.bug == "wrong-kv":
            tokens = np.where(seq_ids == 1, (tokens + 1) % self.info.n_vocab, tokens).astype(np.int32)
        logits = self.inner.decode(tokens, positions, seq_ids, want_logits)
        if self.bug == "wrong-row" and len(logits) >= 2:
            logits = logits.copy()
            logits[[0, 1]] = logits[[1, 0]]
        return logits


@pytest.mark.parametrize("bug", ["wrong-row", "wrong-kv"])
def test_the_criterion_flags_a_planted_bug(backend, seq_traces, bug: str) -> None:
    report = compare_runs(seq_traces, traces(PlantedBug(backend, bug), "cont", prefill_chunk_tokens=64))
    assert not report.passed and report.flagged, report.describe()
