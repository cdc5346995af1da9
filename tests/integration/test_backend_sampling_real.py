"""llama.cpp's backend sampling on the real embedded model: a greedy token picked in the graph is the host's
argmax of the same logits. Compared within one batch only: when a row that reads logits shares the micro-batch,
llama.cpp copies every row's logits, the picked rows' included (llama-context.cpp, needs_raw_logits)."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.device_greedy import DeviceGreedy
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.speculative import SpecConfig
from cobali.frontend.offline import LLM

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def backend(model_path: str):
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=256, n_threads=1,
                                             backend_sampling=True))
    yield backend
    backend.close()


def test_picked_tokens_are_the_argmax_of_the_same_logits(backend) -> None:
    """Four sequences decode together, two picked in the graph and two read on the host, for a few steps:
    every picked token is the argmax of its own row of the logits copied in that same decode."""
    prompts = [backend.tokenize(p) for p in PROMPTS]
    for seq in range(4):
        backend.remove_seq(seq)
    tokens = np.concatenate(prompts).astype(np.int32)
    positions = np.concatenate([np.arange(len(p)) for p in prompts]).astype(np.int32)
    seq_ids = np.repeat(np.arange(4), [len(p) for p in prompts]).astype(np.int32)
    want = np.zeros(len(tokens), dtype=np.int8)
    want[np.cumsum([len(p) for p in prompts]) - 1] = WANT_LOGITS
    next_tokens = backend.argmax(backend.decode(tokens, positions, seq_ids, want))
    lengths = np.array([len(p) for p in prompts], dtype=np.int32)
    picked_any = False
    for step in range(4):
        want = np.array([WANT_ARGMAX, WANT_ARGMAX, WANT_LOGITS, WANT_LOGITS], dtype=np.int8)
        logits = backend.decode(next_tokens.astype(np.int32), lengths + step, np.arange(4, dtype=np.int32), want)
        best = backend.argmax(logits)
        host = logits.argmax(axis=1)
        np.testing.assert_array_equal(best, host, err_msg=f"step {step}")
        picked_any |= len(backend.device_greedy.picked_out_rows) == 2
        next_tokens = best
    assert picked_any, "no token was picked in the graph"


def test_engine_mixes_picked_and_host_rows(backend) -> None:
    """Through the engine: greedy requests picked in the graph beside a logprobs request on the host, every
    decode checked as above, and the logprobs request's answers still read its own logits."""
    checked, batch_rows = [], []
    inner_argmax, inner_decode = backend.argmax, backend.decode

    def recording_decode(tokens, positions, seq_ids, want_logits):
        batch_rows.append(len(tokens))
        return inner_decode(tokens, positions, seq_ids, want_logits)

    def checking_argmax(logits: np.ndarray) -> np.ndarray:
        best = inner_argmax(logits)
        picked = backend.device_greedy.picked_out_rows
        # Checked when a host row shared the one micro-batch of a decode-only batch: all logits were copied
        # (prefill chunks of different lengths split into micro-batches, whose logits may be missing).
        if len(picked) < len(logits) == batch_rows[-1]:
            np.testing.assert_array_equal(best[picked], logits[picked].argmax(axis=1))
            checked.append(len(picked))
        return best

    backend.argmax, backend.decode = checking_argmax, recording_decode
    try:
        engine = Engine(backend, EngineConfig(max_slots=4, n_batch=256))
        greedy = [engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in PROMPTS[:3]]
        with_logprobs = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1))
        list(LLM(engine).run())
    finally:
        del backend.argmax, backend.decode
    assert all(len(r.output_tokens) == 8 and r.error is None for r in [*greedy, with_logprobs])
    # Prompts are admitted over the first ticks: the three greedy requests then decode beside the host row.
    assert checked.count(3) >= 4, f"too few decodes checked with every greedy row picked: {checked}"
    for token, logprob in zip(with_logprobs.output_tokens, with_logprobs.logprobs, strict=True):
        assert logprob.token == token and logprob.top[0][0] == token  # greedy: its own logits' argmax


def test_guessed_rows_are_picked_in_the_graph(model_path: str) -> None:
    """Speculative decoding: a decode row and the guesses behind it, all of one sequence, picked in the graph
    (llama.cpp refuses more picked outputs per sequence than the context was made for)."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1, n_batch=64, n_threads=1,
                                             backend_sampling=True, max_outputs_per_seq=4))
    picked, inner_argmax = [], backend.argmax

    def counting_argmax(logits: np.ndarray) -> np.ndarray:
        best = inner_argmax(logits)
        picked.append(len(backend.device_greedy.picked_out_rows))
        return best

    backend.argmax = counting_argmax
    try:
        engine = Engine(backend, EngineConfig(max_slots=1, n_batch=64, spec=SpecConfig(3)))
        (request,) = LLM(engine).generate([PROMPTS[2]], SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        backend.close()
    assert request.error is None and len(request.token_ids) == 24
    assert engine.stats().accepted_draft_tokens > 0 and max(picked) > 1


@pytest.mark.parametrize("token_only", [True, False], ids=["token-only chain", "llama.cpp's greedy alone"])
def test_picked_rows_copy_logits_only_with_the_greedy_sampler_alone(model_path: str, token_only: bool) -> None:
    """Four sequences decoding together, three picked in the graph: with the token-only chain llama.cpp copies
    none of their logits into its sampling buffer (a decode of picked rows only, none to the host's logits
    either); llama.cpp's greedy sampler alone copies every picked row's. In the decode that shares its
    micro-batch with a host row, every picked token is the host's argmax of that row's logits."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=64, n_threads=1,
                                             backend_sampling=True, count_decodes=True))
    backend.device_greedy = DeviceGreedy(backend.ctx, 4, token_only=token_only)
    try:
        seqs, positions = np.arange(4, dtype=np.int32), np.zeros(4, dtype=np.int32)
        tokens = np.array([backend.tokenize(p)[0] for p in PROMPTS], dtype=np.int32)
        for step, wants in enumerate([[WANT_ARGMAX] * 4, [WANT_ARGMAX] * 3 + [WANT_LOGITS]]):
            logits = backend.decode(tokens, positions + step, seqs, np.array(wants, dtype=np.int8))
            picked = backend.device_greedy.picked_out_rows
            counts = backend.decode_counts[-1]
            assert len(picked) == wants.count(WANT_ARGMAX) and counts.passes == 1
            assert counts.sampled_logits_rows == (0 if token_only else len(picked))
            assert counts.raw_logits_rows == (0 if step == 0 else 4)
            tokens = backend.argmax(logits).astype(np.int32)
        np.testing.assert_array_equal(tokens[picked], logits[picked].argmax(axis=1))
    finally:
        backend.close()
