"""Greedy tokens picked by the backend (llama.cpp's backend sampling): the engine marks the rows that need only
their argmax (WANT_ARGMAX), a backend may then hand over no logits for them, and nothing else changes.

The fake backend with device_argmax returns those rows' logits as NaN, so a host that reads them, or samples
them with a chain, goes visibly wrong. The llama.cpp backend's attach/detach bookkeeping is checked here
against recorded llama.cpp calls; tests/integration/test_backend_sampling_real.py runs it for real.
"""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.base import WANT_ARGMAX, WANT_LOGITS
from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
KINDS = {
    "greedy": GREEDY,
    "greedy_logprobs": SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
    "greedy_prompt_logprobs": SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=1),
    "sampled": SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3),
    "penalized": SamplingParams(max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
    "biased": SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((5, 3.0),)),
}


def run(device_argmax: bool, kinds: list[str]) -> tuple[list, FakeBackend]:
    backend = FakeBackend(n_seq_max=4, device_argmax=device_argmax)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=64, prefill_chunk_tokens=5))
    requests = [engine.add_request([1 + (i * 11 + j) % 90 for j in range(8 + i)], KINDS[kind])
                for i, kind in enumerate(kinds)]
    list(LLM(engine).run())
    return requests, backend


def test_needs_only_argmax_is_greedy_without_logprobs() -> None:
    assert [k for k, p in KINDS.items() if p.needs_only_argmax] == ["greedy", "greedy_prompt_logprobs"]


def test_device_picked_tokens_change_nothing_the_host_reads() -> None:
    """Every kind of request shares batches (and slots, one after another) with device-picked rows: the
    tokens, logprobs and prompt logprobs are the host path's, and exactly the argmax-only rows were picked
    on the device (a prompt-logprobs request's first token reads its prefill's logits, so the host's)."""
    kinds = list(KINDS) * 2
    host, _ = run(False, kinds)
    device, backend = run(True, kinds)
    for kind, h, d in zip(kinds, host, device, strict=True):
        assert d.error is None and d.output_tokens == h.output_tokens, (kind, d.error)
        assert d.logprobs == h.logprobs and d.prompt_logprobs == h.prompt_logprobs, kind
    expected = sum(len(r.output_tokens) - (r.params.prompt_logprobs is not None)
                   for r in device if r.params.needs_only_argmax)
    assert backend.n_picked == expected > 0


@pytest.mark.parametrize("kind", ["greedy_logprobs", "sampled", "biased"])
def test_rows_that_read_logits_are_never_marked_argmax_only(kind: str) -> None:
    backend = FakeBackend(n_seq_max=4)
    engine = Engine(backend, EngineConfig(max_slots=4, n_batch=64))
    LLM(engine).generate([[3, 4, 5], [6, 7, 8]], KINDS[kind])
    assert backend.batches and all(
        WANT_ARGMAX not in b.want_logits for b in backend.batches), "a logits-reading row was marked WANT_ARGMAX"


# ---- the llama.cpp backend's attachments, against recorded llama.cpp calls -----------------------------------


class RecordedLlama:
    """The few llama_cpp calls DeviceGreedy makes, recorded; chains are numbered."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.attached: dict[int, int] = {}  # seq -> chain
        self.freed: list[int] = []
        self.n_chains = 0
        self.sampled: dict[int, int] = {}  # batch row -> token

    def llama_sampler_chain_default_params(self):
        return None

    def llama_sampler_chain_init(self, params) -> int:
        self.n_chains += 1
        return self.n_chains

    def llama_sampler_init_greedy(self) -> str:
        return "greedy"

    def llama_sampler_init(self, iface, ctx) -> str:
        return "logits-dropping step"

    def llama_sampler_chain_add(self, chain, sampler) -> None:
        pass

    def llama_set_sampler(self, ctx, seq: int, chain) -> bool:
        if chain is None:
            self.attached.pop(seq)
            return True
        if self.refuse:
            return False
        assert chain not in self.attached.values() and chain not in self.freed, "a chain attached twice"
        self.attached[seq] = chain
        return True

    def llama_sampler_free(self, chain) -> None:
        assert chain not in self.attached.values(), "freed while attached"
        self.freed.append(chain)

    def llama_get_sampled_token_ith(self, ctx, row: int) -> int:
        return self.sampled.get(row, -1)


@pytest.fixture
def llama(monkeypatch) -> RecordedLlama:
    from cobali.backends.llama_cpp import device_greedy

    recorded = RecordedLlama()
    monkeypatch.setattr(device_greedy, "ll", recorded)
    return recorded


def batch(*rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(seq, want) per row."""
    seqs, wants = zip(*rows, strict=True)
    return np.array(seqs, dtype=np.int32), np.array(wants, dtype=np.int8)


def test_sequences_stay_attached_while_their_rows_need_only_argmax(llama) -> None:
    from cobali.backends.llama_cpp.device_greedy import DeviceGreedy

    greedy = DeviceGreedy(ctx=None, n_seq_max=4)
    # A prefill (no output on its first rows) for seq 0, a decode for seq 1 that reads logits, one for seq 2.
    greedy.prepare(*batch((0, 0), (0, WANT_ARGMAX), (1, WANT_LOGITS), (2, WANT_ARGMAX)))
    assert llama.attached == {0: 1, 2: 2}
    llama.sampled = {1: 7, 3: 9}
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[1, 4] = 1.0  # the host row's argmax; the device rows' logits rows are never read
    logits[[0, 2]] = np.nan
    assert greedy.tokens(logits).tolist() == [7, 4, 9]
    greedy.prepare(*batch((0, WANT_ARGMAX), (2, WANT_ARGMAX), (3, 0)))
    assert greedy.n_attach_changes == 2, "an unchanged sequence was re-attached (each costs a graph reserve)"
    # A request that reads logits takes over seq 2: detached before its decode; a later greedy one gets a new chain.
    greedy.prepare(*batch((0, WANT_ARGMAX), (2, WANT_LOGITS)))
    assert llama.attached == {0: 1} and llama.freed == [2]
    greedy.prepare(*batch((2, WANT_ARGMAX)))
    assert llama.attached == {0: 1, 2: 3}
    greedy.close()
    assert llama.attached == {} and sorted(llama.freed) == [1, 2, 3]


def test_a_refused_chain_leaves_every_row_on_the_host(llama) -> None:
    from cobali.backends.llama_cpp.device_greedy import DeviceGreedy

    llama.refuse = True
    greedy = DeviceGreedy(ctx=None, n_seq_max=2)
    greedy.prepare(*batch((0, WANT_ARGMAX), (1, WANT_ARGMAX)))
    assert not greedy.supported and llama.attached == {} and llama.freed == [1]
    logits = np.eye(2, 5, k=2, dtype=np.float32)
    assert greedy.tokens(logits).tolist() == [2, 3]


@pytest.mark.parametrize(("flags", "expected"), [([], False), (["--backend-sampling"], True)])
def test_the_flag_reaches_the_llama_cpp_config(flags: list[str], expected: bool) -> None:
    from cobali.config.flags import backend_config
    from cobali.faces.cli import build_parser

    args = build_parser().parse_args(["serve", *flags])
    assert backend_config(args).backend_sampling is expected
