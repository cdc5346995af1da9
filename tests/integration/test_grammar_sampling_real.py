"""Sampling under a grammar on the embedded model: which distribution a constrained row is drawn from, which logits
row a sampler reads, and what a grammar that allows nothing more does (it fails its own request, nothing else).

The guide masks a constrained row to the tokens its grammar allows before the request's llama.cpp chain reads it
(cobali.structured.guide): the chain's top-k, top-p and temperature then act on the allowed tokens only, so the
draw follows the model's distribution over them, renormalised ("grammar first"). llama-server instead draws from
its truncated chain and only then asks the grammar (a refused draw falls back): a different distribution, which
the tests below tell apart."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
from llguidance import LLMatcher

from cobali.backends.llama_cpp import LlamaCppBackend
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.request import FinishReason, Request
from cobali.engine.sampling import RowSampler
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.structured.compiler import GrammarCompiler
from cobali.structured.grammars import choice_grammar
from cobali.structured.guide import Guide
from tests.integration.test_server_openai import running_server

ANIMALS = choice_grammar([" dog", " lion", " rabbit", " tiger", " penguin"], "choice")
ANIMALS_GBNF = 'root ::= " dog" | " lion" | " rabbit" | " tiger" | " penguin"'
# With the model's favourite (" cat") and four it likes less: under top_k=6, grammar-first and llama-server's
# draw-then-check give first-token distributions 0.10 apart (total variation).
WITH_CAT = choice_grammar([" cat", " lion", " rabbit", " tiger", " penguin"], "choice")
# No text matches X: the first allows no token at all, the second none after its text.
NOTHING = "start: X\nX: /a/ & /b/"
DEAD_END = 'start: "The answer is" X\nX: /a/ & /b/'
REFUSED = "the constraint"
DRAWS = 3000


@pytest.fixture(scope="module")
def backend(model_path: str) -> Iterator[LlamaCppBackend]:
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=128))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def compiler(backend: LlamaCppBackend) -> GrammarCompiler:
    return GrammarCompiler(backend.guidance_tokenizer)


@dataclass
class Drawn:
    """What RowSampler reads of a request (cobali.engine.sampling.Sampling)."""

    id: int
    params: SamplingParams
    n_sampled: int = 0


def decode_prompts(backend: LlamaCppBackend, prompts: list[str]) -> tuple[np.ndarray, list[int]]:
    """One decode of the prompts, each in its own sequence (cleared first): the logits of their last rows (the
    backend's own buffer, which a chain reads), and those rows' batch indices."""
    tokens = [backend.tokenize(p) for p in prompts]
    for seq in range(len(prompts)):
        backend.remove_seq(seq)
    seq_ids = np.concatenate([np.full(len(t), s, dtype=np.int32) for s, t in enumerate(tokens)])
    positions = np.concatenate([np.arange(len(t), dtype=np.int32) for t in tokens])
    last_rows = (np.cumsum([len(t) for t in tokens]) - 1).tolist()
    want = np.zeros(len(seq_ids), dtype=bool)
    want[last_rows] = True
    logits = backend.decode(np.concatenate(tokens).astype(np.int32), positions, seq_ids, want)
    return logits, last_rows


def allowed_first(compiler: GrammarCompiler, grammar: str) -> np.ndarray:
    mask = np.frombuffer(compiler.matcher(grammar).compute_bitmask(), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(mask, bitorder="little", count=compiler.tokenizer.vocab_size))


def first_draws(backend: LlamaCppBackend, compiler: GrammarCompiler, grammar: str, **params) -> Counter:
    """DRAWS seeded first tokens of one row, each by a fresh request through RowSampler, as the engine samples."""
    logits, [row] = decode_prompts(backend, ["My favourite animal is the"])
    before = logits[0].copy()
    sampler = RowSampler(backend, np.flatnonzero(backend.eog_mask()), Guide(compiler, backend.info.n_vocab))
    draws: Counter = Counter()
    for seed in range(DRAWS):
        request = Drawn(seed, SamplingParams(seed=seed, grammar=grammar, **params))
        (token,), failures = sampler.sample(logits, [request], [row], [0])
        assert not failures, failures
        draws[token] += 1
        sampler.forget(seed)
    assert np.array_equal(logits[0], before)  # each row is put back: the next draw (and logprobs) see the model's
    assert not sampler.guide._matchers
    return draws


def distribution(row: np.ndarray, among: np.ndarray, k: int | None = None) -> dict[int, float]:
    """Temperature 1 over the k most likely of the tokens `among` (all of them: k None)."""
    best = among[np.argsort(-row[among], kind="stable")[:k]]
    weights = np.exp(row[best] - row[best].max())
    return dict(zip(best.tolist(), (weights / weights.sum()).tolist(), strict=True))


def distance(draws: Counter, expected: dict[int, float]) -> float:
    """Total variation between the draws' frequencies and `expected`."""
    support = set(draws) | set(expected)
    return sum(abs(draws[t] / DRAWS - expected.get(t, 0.0)) for t in support) / 2


@pytest.mark.parametrize("top_k", [0, 6])
def test_a_constrained_row_is_drawn_from_the_allowed_tokens_renormalised(backend: LlamaCppBackend,
                                                                        compiler: GrammarCompiler,
                                                                        top_k: int) -> None:
    """Temperature 1, untruncated and top_k=6 (llama-server's default chain truncates): 3000 seeded draws of the
    first token stay within 0.05 (total variation) of the model's distribution over the allowed tokens (top 6 of
    them), renormalised, and clearly further from what llama-server's draw-then-check would give."""
    allowed = allowed_first(compiler, WITH_CAT)
    logits, _ = decode_prompts(backend, ["My favourite animal is the"])
    row = logits[0].astype(np.float64)
    expected = distribution(row, allowed, top_k or None)
    assert max(expected.values()) < 0.9  # several tokens matter, so a skewed draw would show
    draws = first_draws(backend, compiler, WITH_CAT, temperature=1.0, top_k=top_k)
    assert set(draws) <= set(allowed.tolist())
    assert distance(draws, expected) < 0.05, (distance(draws, expected), draws.most_common(6))
    if top_k:  # llama-server: one draw from the model's top k; a refused one falls back to the grammar-first draw
        unconstrained = distribution(row, np.arange(len(row)), top_k)
        refused = sum(p for t, p in unconstrained.items() if t not in set(allowed.tolist()))
        draw_then_check = {t: unconstrained.get(t, 0.0) + refused * p for t, p in expected.items()}
        assert 0.3 < refused < 0.95  # the first draw and the fallback both matter here
        assert distance(draws, draw_then_check) > distance(draws, expected) + 0.04


def test_a_greedy_constrained_row_takes_the_most_likely_allowed_token(backend: LlamaCppBackend,
                                                                     compiler: GrammarCompiler) -> None:
    allowed = allowed_first(compiler, ANIMALS)
    logits, _ = decode_prompts(backend, ["My favourite animal is the"])
    best = int(allowed[np.argmax(logits[0][allowed])])
    assert best != int(np.argmax(logits[0]))  # the model's own favourite is refused
    draws = first_draws(backend, compiler, ANIMALS, temperature=0.0)
    assert set(draws) == {best}


def test_a_sampler_reads_its_own_row_of_the_batch(backend: LlamaCppBackend, compiler: GrammarCompiler) -> None:
    """Three sequences in one decode: a constrained greedy pick is the best allowed token of that request's own
    row, not of another's (the mask lands on the row the request's chain reads)."""
    anything = LLMatcher.grammar_from_lark("start: /(?s:.+)/")
    allowed = allowed_first(compiler, anything)
    logits, rows = decode_prompts(backend, ["The capital of France is", "1, 2, 3, 4,", "My favourite animal is the"])
    best = [int(allowed[np.argmax(row[allowed])]) for row in logits]
    assert len(set(best)) == 3
    sampler = RowSampler(backend, np.flatnonzero(backend.eog_mask()), Guide(compiler, backend.info.n_vocab))
    requests = [Drawn(i, SamplingParams(temperature=0.0, grammar=anything)) for i in range(3)]
    tokens, failures = sampler.sample(logits, requests, rows, [0, 1, 2])
    assert not failures and tokens == best
    for i in range(3):
        sampler.forget(i)


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
                                    {"temperature": 1.0, "top_k": 4, "min_p": 0.01, "seed": 3}], ids=str)
def test_a_grammar_that_allows_no_token_fails_its_request_only(model_path: str, params: dict) -> None:
    """A grammar that allows nothing (from the start, or after its text) ends its own request as an error of its
    own (a 400), while the requests beside it and after it run."""
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=4, n_batch=128))
    try:
        engine = Engine(backend, EngineConfig(mode="cont", max_slots=4, n_batch=128))
        requests = run_beside_each_other(engine, params)
        assert not engine._executor.sampler.guide._matchers
    finally:
        backend.close()
    nothing, dead_end, beside, after = requests
    for failed in (nothing, dead_end):
        assert failed.finish_reason is FinishReason.ERROR and failed.own_fault, failed.error
        assert REFUSED in failed.error
    assert not nothing.output_tokens
    assert dead_end.text == "The answer is"  # it wrote its text first
    assert beside.finish_reason is FinishReason.STOP, beside.error
    assert after.finish_reason is FinishReason.STOP, after.error


def run_beside_each_other(engine: Engine, params: dict) -> list[Request]:
    """Both refused grammars and a good one in one batch, then a good one alone. 16 tokens reach the dead end:
    its text has 13 characters, so at most 13 tokens."""
    grammars = [LLMatcher.grammar_from_lark(NOTHING), LLMatcher.grammar_from_lark(DEAD_END), ANIMALS]
    prompts = ["Say something.", "Say something.", "Name an animal."]
    requests = [engine.add_request(prompt, SamplingParams(max_tokens=16, grammar=grammar, **params))
                for prompt, grammar in zip(prompts, grammars, strict=True)]
    list(LLM(engine).run())
    requests.append(engine.add_request("Name an animal.", SamplingParams(max_tokens=16, grammar=ANIMALS, **params)))
    list(LLM(engine).run())
    return requests


def test_the_server_answers_a_grammar_that_allows_no_token_with_a_400() -> None:
    """Through `cobali serve` (llama-server's `grammar` field): a grammar that allows nothing at all is refused
    before it is queued, one that allows nothing after its text when it gets there; either is a 400 naming the
    constraint, the requests beside them finish, and the server stays up."""
    with running_server("--max-slots", "4") as (base, proc), httpx.Client(base_url=base, timeout=120) as http:
        def complete(grammar: str | None) -> httpx.Response:
            body = {"prompt": "Say something.", "max_tokens": 24, "temperature": 1.0, "seed": 1}
            return http.post("/v1/completions", json=body | ({"grammar": grammar} if grammar else {}))

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, [ANIMALS_GBNF, NOTHING, DEAD_END, None]))
        assert "allows no output" in replies[1].json()["error"]["message"], replies[1].text
        for reply in (replies[1], replies[2]):  # the request's own fault: a 400 (a 503 would have clients retry)
            assert reply.status_code == 400 and REFUSED in reply.json()["error"]["message"], reply.text
        assert replies[0].status_code == replies[3].status_code == 200, (replies[0].text, replies[3].text)
        assert replies[0].json()["choices"][0]["text"] in ANIMALS_GBNF
        streamed = http.post("/v1/completions", json={"prompt": "Say something.", "max_tokens": 24, "stream": True,
                                                      "grammar": DEAD_END})
        *_, last_event, end = [line for line in streamed.text.splitlines() if line]
        assert end == "data: [DONE]"  # after the error event, the stream's end
        error = json.loads(last_event.removeprefix("data: "))["error"]
        assert streamed.status_code == 200 and error["type"] == "invalid_request_error", streamed.text
        assert REFUSED in error["message"]
        assert complete(None).status_code == 200 and proc.poll() is None
