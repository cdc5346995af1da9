"""What a replica holds, hashed for a router (engine/prefix_digest.py), and its routing report from the engine core
(EngineCore.routing_report, with the engine's load from Engine's named methods). Through the message boundary:
tests/unit/frontend/test_routing_report.py."""

from __future__ import annotations

import numpy as np

from cobali.backends.fake import FakeBackend
from cobali.engine.core import MAX_DIGESTS, EngineCore
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.messages import CallDone, FromCore, ReadRoutingReport
from cobali.engine.prefix_digest import DigestBuilder, block_hashes, prompt_blocks
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

B = 4  # tokens per block in these tests


def tokens(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 90 for i in range(n)]


def test_block_hashes_chain_whole_blocks_and_are_stable() -> None:
    a, b = tokens(10, 1), tokens(10, 2)
    assert len(block_hashes(a, B)) == 2, "only whole blocks"
    assert block_hashes(a[:8] + b[8:], B) == block_hashes(a, B), "what follows the blocks changes nothing"
    changed = [a[0] + 1, *a[1:]]
    assert not set(block_hashes(changed, B)) & set(block_hashes(a, B)), "a block's hash stands for all before it"
    # Router and replicas are different processes: the hash may not be Python's salted hash().
    assert block_hashes(list(range(1, 5)), B) == [0x2BA42C3CDEEFADA8]


def test_a_prompt_is_hashed_without_its_last_token_and_under_its_salt() -> None:
    prompt = tokens(9, 3)
    assert prompt_blocks(prompt, B) == block_hashes(prompt, B), "9 tokens: 2 blocks either way"
    assert prompt_blocks(prompt[:8], B) == block_hashes(prompt, B)[:1], "the last token is always computed"
    salted = prompt_blocks(prompt, B, cache_salt="tenant")
    assert len(salted) == 2 and not set(salted) & set(prompt_blocks(prompt, B))


def make_engine(slots: int = 2, host_mib: int = 0) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_batch=64, kv_bytes_per_token=2**20 // 64)
    return Engine(backend, EngineConfig(max_slots=slots, n_batch=64, host_cache_mib=host_mib))


def run(engine: Engine, prompt: list[int], salt: str | None = None) -> None:
    LLM(engine).generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, cache_salt=salt))


def test_an_engines_digest_holds_what_its_next_turn_reuses() -> None:
    engine = make_engine(host_mib=8)  # 512 tokens
    context = tokens(40, 5)
    run(engine, context)
    run(engine, tokens(40, 6), salt="other")
    digest = set(DigestBuilder(B, 1000).digest(engine.held_prefixes()))
    follow_up = context + tokens(12, 7)
    assert all(h in digest for h in prompt_blocks(follow_up, B)[:10]), "the context's 10 blocks"
    assert prompt_blocks(follow_up, B)[10] not in digest
    assert not set(prompt_blocks(tokens(40, 6), B)) & digest, "another salt's KV matches no unsalted prompt"
    assert set(prompt_blocks(tokens(40, 6), B, cache_salt="other")) <= digest
    for n in range(3, 6):  # more prompts than slots: the older ones live on in host memory
        run(engine, tokens(40, n * 10))
    assert len(engine.held_prefixes()) > 2
    assert set(prompt_blocks(context, B)) <= set(DigestBuilder(B, 1000).digest(engine.held_prefixes()))


def test_a_digest_is_capped_most_recent_first_and_never_holds_a_block_without_its_predecessors() -> None:
    recent, shared, old = (np.asarray(tokens(40, s), dtype=np.int64) for s in (1, 2, 3))
    extended = np.concatenate([shared, tokens(8, 4)])
    digest = DigestBuilder(B, max_blocks=21).digest([recent, shared, extended, old])
    chain = block_hashes(extended, B)  # 12 blocks, the first 10 shared's
    assert digest == block_hashes(recent, B) + chain[:11], "in order, blocks held twice once"
    assert [h in digest for h in chain] == [True] * 11 + [False], "what is held of a prefix is its start"


def test_a_digest_rehashes_only_arrays_it_has_not_seen() -> None:
    cached = [np.asarray(tokens(400, s), dtype=np.int64) for s in range(8)]
    builder = DigestBuilder(B, 10_000)
    first = builder.digest(cached)
    assert builder.hashed_blocks == 800
    running = np.asarray(tokens(40, 99), dtype=np.int64)
    assert builder.digest([running, *cached]) == block_hashes(running, B) + first
    assert builder.hashed_blocks == 810, "the cached prefixes' hashes came from the last digest"
    assert builder.digest([np.array(a) for a in cached]) == first and builder.hashed_blocks == 1610, "copies"


def test_the_engines_load_as_a_router_reads_it() -> None:
    backend = FakeBackend(n_seq_max=2, n_batch=64)
    engine = Engine(backend, EngineConfig(max_slots=2, n_batch=64, prefill_chunk_tokens=16))
    requests = [engine.add_request(tokens(40, s), SamplingParams(max_tokens=100, ignore_eos=True)) for s in range(3)]
    assert (engine.n_queued, engine.n_running, engine.waiting_tokens(), engine.kv_use()) == (3, 0, 120, 0.0)
    engine.step()  # two take the slots, each with a 16-token chunk
    assert (engine.n_queued, engine.n_running) == (1, 2)
    assert engine.waiting_tokens() == 120 - 32 == sum(40 - r.computed_tokens for r in requests)
    while any(r.computed_tokens < 40 for r in requests[:2]):
        engine.step()
    assert engine.waiting_tokens() == 40, "the decoding requests have none left: the third's whole prompt"
    in_kv = sum(r.computed_tokens for r in requests[:2])
    assert in_kv >= 80 and engine.kv_use() == in_kv / backend.info.n_ctx


def core_after(prompts: list[list[int]]) -> tuple[EngineCore, list[FromCore]]:
    """A core over an engine that served `prompts`, the last most recently; what it sends."""
    engine = make_engine(host_mib=8)
    for prompt in prompts:
        run(engine, prompt)
    sent: list[FromCore] = []
    return EngineCore(engine, sent.append), sent


def test_a_core_reports_between_ticks_what_it_holds_and_hashes_only_what_changed() -> None:
    old, recent = tokens(40, 1), tokens(40, 2)
    core, sent = core_after([old, recent])
    builder = core.digest_builder(B, 1000)
    core.handle(ReadRoutingReport(7, B, 1000))
    answer = sent[-1]
    assert isinstance(answer, CallDone) and answer.call_id == 7 and answer.report is not None
    report = answer.report
    assert report.hashes[:10] == prompt_blocks([*recent, 1], B), "the most recently used prefix first"
    assert set(prompt_blocks([*old, 1], B)) <= set(report.hashes)
    assert (report.n_waiting, report.n_running, report.waiting_tokens, report.kv_use) == (0, 0, 0, 0.0)
    hashed = builder.hashed_blocks
    assert hashed >= 20, "both prefixes hashed once"
    assert core.routing_report(B, 1000) == report and builder.hashed_blocks == hashed, "the cached prefixes' hashes"
    assert core.routing_report(B, 3).hashes == report.hashes[:3], "capped at max_blocks"


def test_a_core_refuses_a_report_of_no_blocks_and_keeps_few_digests() -> None:
    core, sent = core_after([tokens(40, 1)])
    core.handle(ReadRoutingReport(1, 0, 1000))
    assert isinstance(sent[-1], CallDone) and sent[-1].error_kind == "ValueError"
    first = core.digest_builder(B, 10)
    for n in range(MAX_DIGESTS - 1):
        core.routing_report(B, 100 + n)
    assert core.digest_builder(B, 10) is first, "asked again: kept"
    core.routing_report(B, 1)
    assert list(core._digests) == [(B, 101), (B, 102), (B, 10), (B, 1)], "the least recently asked forgotten"


def test_a_running_request_is_hashed_only_for_the_blocks_it_gained() -> None:
    from cobali.engine.prefix_digest import GrowingKeys
    from cobali.engine.request import Request

    for salt, lora in ((None, 0), ("tenant", 0), ("tenant", 2)):
        request = Request(1, tokens(40, 5), SamplingParams(cache_salt=salt), lora=lora)
        builder = DigestBuilder(B, 1000)
        for n in (3, 5, 9, 9, 30, 40, 12):  # growing (a block at a time within the salt marks), then preempted
            digest = builder.digest([GrowingKeys(request.id, n, request.kv_key)])
            assert digest == block_hashes(request.kv_key(n), B), (salt, lora, n)
        assert builder.hashed_blocks == 10, "each of the 10 blocks hashed once"
