"""Sampling under a grammar on the embedded model: which distribution a chain draws from, which logits row a
sampler reads, and what a grammar that allows no token does (it fails its own request, nothing else)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from cobali.backends.base import SamplingParams
from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.grammar_check import GrammarCheck
from cobali.backends.llama_cpp.sampler import REDRAWS
from cobali.backends.llama_cpp_config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason, Request
from tests.integration.test_server_openai import running_server

ANIMALS = 'root ::= " dog" | " lion" | " rabbit" | " tiger" | " penguin"'
# llama.cpp's grammars never match a NUL: the first allows no token at all, the second none after its text.
NOTHING = r"root ::= [\x00]"
DEAD_END = r'root ::= "The answer is" [\x00]'
REFUSED = "the grammar allows no token"
TOP_K = 6


@pytest.fixture(scope="module")
def backend(model_path: str) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=128))
    yield backend
    backend.close()


def decode_prompts(backend: LlamaCppBackend, prompts: list[str]) -> tuple[np.ndarray, list[int]]:
    """One decode of the prompts, each in its own sequence (cleared first); the logits of their last rows, and
    those rows' batch indices."""
    tokens = [backend.tokenize(p) for p in prompts]
    for seq in range(len(prompts)):
        backend.remove_seq(seq)
    seq_ids = np.concatenate([np.full(len(t), s, dtype=np.int32) for s, t in enumerate(tokens)])
    positions = np.concatenate([np.arange(len(t), dtype=np.int32) for t in tokens])
    last_rows = (np.cumsum([len(t) for t in tokens]) - 1).tolist()
    want = np.zeros(len(seq_ids), dtype=bool)
    want[last_rows] = True
    logits = backend.decode(np.concatenate(tokens).astype(np.int32), positions, seq_ids, want)
    return logits.astype(np.float64), last_rows


def top_k_distribution(row: np.ndarray, among: np.ndarray, k: int) -> dict[int, float]:
    """Temperature 1 over the k most likely of the tokens `among`."""
    best = among[np.argsort(-row[among])[:k]]
    weights = np.exp(row[best] - row[best].max())
    return dict(zip(best.tolist(), (weights / weights.sum()).tolist(), strict=True))


def test_a_truncating_chain_draws_once_then_runs_the_grammar_first(backend: LlamaCppBackend, model_path: str) -> None:
    """top_k=6, as llama-server: one draw from the model's top 6; if the grammar refuses it, the top 6 of the
    tokens the grammar allows. Masking refused draws and truncating again (planted) moves the first token's
    distribution by 0.24 in total variation here; 2000 seeded draws must stay within 0.05 of llama-server's."""
    checker = GrammarCheck(model_path)
    try:
        allowed = np.array(sorted(checker.first_tokens(ANIMALS)))
    finally:
        checker.close()
    logits, [row_index] = decode_prompts(backend, ["My favourite animal is the"])
    row = logits[0]
    draw = top_k_distribution(row, np.arange(len(row)), TOP_K)
    refused = sum(p for token, p in draw.items() if token not in allowed)
    expected = {int(t): draw.get(int(t), 0.0) for t in allowed}
    for token, p in top_k_distribution(row, allowed, TOP_K).items():
        expected[token] += refused * p
    assert 0.5 < refused < 0.95  # both the first draw and the fallback matter
    draws = []
    for seed in range(2000):
        sampler = backend.new_sampler(SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, grammar=ANIMALS))
        draws.append(sampler.sample(row_index))
        sampler.close()
    counts = Counter(draws)
    distance = sum(abs(counts[t] / len(draws) - p) for t, p in expected.items()) / 2
    assert distance < 0.05, (distance, counts.most_common(6), sorted(expected.items(), key=lambda e: -e[1])[:6])


@pytest.mark.parametrize(("params", "draws"), [
    ({"temperature": 0.0, "top_k": 4, "top_p": 0.5}, REDRAWS),  # greedy: top-k/p never enter the chain
    ({"temperature": 1.0}, REDRAWS), ({"temperature": 1.0, "top_k": 1 << 20}, REDRAWS),
    ({"temperature": 0.7, "repetition_penalty": 1.3, "logit_bias": ((5, 2.0),)}, REDRAWS),
    ({"temperature": 1.0, "top_k": 40}, 1), ({"temperature": 1.0, "top_p": 0.95}, 1),
    ({"temperature": 1.0, "min_p": 0.05}, 1),
], ids=str)
def test_only_a_chain_that_truncates_nothing_draws_again(backend: LlamaCppBackend, params: dict, draws: int) -> None:
    sampler = backend.new_sampler(SamplingParams(grammar=ANIMALS, **params))
    try:
        assert sampler.draws == draws
    finally:
        sampler.close()


def test_a_sampler_reads_its_own_row_of_the_batch(backend: LlamaCppBackend) -> None:
    """Three sequences in one decode: under a grammar (which reads the logits in Python) a greedy pick is the
    argmax of that request's row, not of another's."""
    logits, rows = decode_prompts(backend, ["The capital of France is", "1, 2, 3, 4,", "My favourite animal is the"])
    assert len({int(r.argmax()) for r in logits}) == 3
    for out_row, row in enumerate(rows):
        sampler = backend.new_sampler(SamplingParams(temperature=0.0, grammar=r"root ::= [^\x00]*"))
        try:
            assert sampler.sample(row) == int(logits[out_row].argmax())
        finally:
            sampler.close()


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                    {"temperature": 1.0, "top_k": 4, "min_p": 0.01, "seed": 3}], ids=str)
def test_a_grammar_that_allows_no_token_fails_its_request_only(model_path: str, params: dict) -> None:
    """llama.cpp aborts the whole process when a sampler accepts a token the grammar refuses: a grammar that
    allows nothing (from the start, or after its text) must end its own request as an error, while the
    requests beside it and after it run."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=128))
    try:
        engine = Engine(backend, EngineConfig(mode="cont", max_slots=4, n_batch=128))
        requests = run_beside_each_other(engine, params)
    finally:
        backend.close()
    nothing, dead_end, beside, after = requests
    assert nothing.finish_reason is FinishReason.ERROR and REFUSED in nothing.error and not nothing.output_tokens
    assert dead_end.finish_reason is FinishReason.ERROR and REFUSED in dead_end.error
    assert len(dead_end.output_tokens) >= 2  # it wrote its text first
    assert beside.finish_reason is FinishReason.STOP, beside.error
    assert after.finish_reason is FinishReason.STOP, after.error


def run_beside_each_other(engine: Engine, params: dict) -> list[Request]:
    """Both refused grammars and a good one in one batch, then a good one alone. 16 tokens reach the dead end:
    its text has 13 characters, so at most 13 tokens."""
    requests = [engine.submit(prompt, SamplingParams(max_tokens=16, grammar=grammar, **params))
                for prompt, grammar in [("Say something.", NOTHING), ("Say something.", DEAD_END),
                                        ("Name an animal.", ANIMALS)]]
    engine.run_until_done()
    requests.append(engine.submit("Name an animal.", SamplingParams(max_tokens=16, grammar=ANIMALS, **params)))
    engine.run_until_done()
    return requests


def test_the_server_answers_a_grammar_that_allows_no_token_with_an_error() -> None:
    """Through `cobali serve` (llama-server's `grammar` field): the request is an error naming the grammar, the
    ones running beside it finish, and the server stays up."""
    with running_server("--max-slots", "4") as (base, proc), httpx.Client(base_url=base, timeout=120) as http:
        def complete(grammar: str | None) -> httpx.Response:
            body = {"prompt": "Say something.", "max_tokens": 24, "temperature": 1.0, "seed": 1}
            return http.post("/v1/completions", json=body | ({"grammar": grammar} if grammar else {}))

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, [None, NOTHING, DEAD_END, None]))
        for reply in (replies[1], replies[2]):  # the request's own fault: a 400 (a 503 would have clients retry)
            assert reply.status_code == 400 and REFUSED in reply.json()["error"]["message"], reply.text
        assert replies[0].status_code == replies[3].status_code == 200, (replies[0].text, replies[3].text)
        streamed = http.post("/v1/completions", json={"prompt": "Say something.", "max_tokens": 24, "stream": True,
                                                      "grammar": DEAD_END})
        error = json.loads(streamed.text.strip().splitlines()[-1].removeprefix("data: "))["error"]
        assert streamed.status_code == 200 and error["type"] == "invalid_request_error", streamed.text
        assert REFUSED in error["message"]
        assert complete(None).status_code == 200 and proc.poll() is None
