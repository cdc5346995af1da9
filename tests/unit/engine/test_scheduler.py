"""Per-tick batch composition, asserted exactly, on the deterministic fake backend."""

from __future__ import annotations

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.plan import ChunkKind
from cobali.engine.request import RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM


def make_engine(mode: str = "cont", slots: int = 4, chunk: int = 256, n_batch: int = 512) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_batch=n_batch)
    return Engine(backend, EngineConfig(mode=mode, max_slots=slots, prefill_chunk_tokens=chunk, n_batch=n_batch))


def prompt(n: int, seed: int = 1) -> list[int]:
    return [1 + (seed * 7 + i) % 90 for i in range(n)]


def params(n: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def shape(engine: Engine) -> list[list[tuple[int, str, int, int]]]:
    """Every tick as [(request, kind, start, n_tokens), ...]."""
    return [[(c.request_id, c.kind.value, c.start, c.n_tokens) for c in t.plan.chunks] for t in engine.ticks]


def test_long_prompt_is_split_256_256_188_at_chunk_256() -> None:
    engine = make_engine(chunk=256)
    engine.add_request(prompt(700), params(2))
    list(LLM(engine).run())
    assert shape(engine) == [
        [(0, "prefill", 0, 256)],
        [(0, "prefill", 256, 256)],
        [(0, "prefill", 512, 188)],
        [(0, "decode", 700, 1)],
    ]
    # Only the chunk that completes the prompt asks for logits, and only on its last row.
    wants = [b.want_logits for b in engine._backend.batches]
    assert [sum(w) for w in wants] == [0, 0, 1, 1] and wants[2][-1]


def test_decodes_come_first_then_prefill_chunks_within_budget() -> None:
    engine = make_engine(chunk=256, n_batch=300)
    engine.add_request(prompt(10, 1), params(5))
    engine.add_request(prompt(10, 2), params(5))
    engine.step()
    engine.add_request(prompt(600, 3), params(2))
    list(LLM(engine).run())
    assert shape(engine)[:4] == [
        [(0, "prefill", 0, 10), (1, "prefill", 0, 10)],
        [(0, "decode", 10, 1), (1, "decode", 10, 1), (2, "prefill", 0, 256)],
        [(0, "decode", 11, 1), (1, "decode", 11, 1), (2, "prefill", 256, 256)],
        [(0, "decode", 12, 1), (1, "decode", 12, 1), (2, "prefill", 512, 88)],
    ]
    for tick in engine.ticks:
        kinds = [c.kind for c in tick.plan.chunks]
        assert kinds == sorted(kinds, key=lambda k: k is ChunkKind.PREFILL), "decode rows must lead the batch"
        assert tick.plan.n_tokens <= 300


def test_budget_caps_prefill_across_requests() -> None:
    engine = make_engine(chunk=256, n_batch=300)
    for seed in range(3):
        engine.add_request(prompt(200, seed), params(1))
    engine.step()
    assert shape(engine) == [[(0, "prefill", 0, 200), (1, "prefill", 0, 100)]]
    assert engine._scheduler.waiting[0].id == 2, "no budget left: the third request waits without a slot"
    assert (engine.ticks[0].n_running, engine.ticks[0].n_waiting) == (2, 1)


def test_freed_slot_is_reused_at_the_next_tick() -> None:
    engine = make_engine(slots=2)
    short = engine.add_request(prompt(5, 1), params(1))
    engine.add_request(prompt(5, 2), params(6))
    late = engine.add_request(prompt(5, 3), params(1))
    engine.step()  # both prefilled; `short` samples its only token and finishes
    assert short.is_finished and short.slot is None
    engine.step()
    assert late.state is not RequestState.PENDING
    assert shape(engine)[1] == [(1, "decode", 5, 1), (2, "prefill", 0, 5)]
    assert engine.ticks[1].plan.chunks[1].slot == engine.ticks[0].plan.chunks[0].slot


def test_static_admits_nothing_until_the_whole_cohort_is_done() -> None:
    engine = make_engine(mode="static", slots=2)
    engine.add_request(prompt(4, 1), params(1))
    engine.add_request(prompt(4, 2), params(4))
    engine.add_request(prompt(4, 3), params(1))
    list(LLM(engine).run())
    assert shape(engine) == [
        [(0, "prefill", 0, 4), (1, "prefill", 0, 4)],
        [(1, "decode", 4, 1)],
        [(1, "decode", 5, 1)],
        [(1, "decode", 6, 1)],
        [(2, "prefill", 0, 4)],
    ]
    # One slot sat idle for three ticks while request 2 waited: the convoy.
    assert [t.plan.wasted_slots for t in engine.ticks] == [0, 1, 1, 1, 0]


def test_seq_mode_never_has_two_requests_in_flight() -> None:
    engine = make_engine(mode="seq", slots=4, n_batch=64)
    for seed in range(4):
        engine.add_request(prompt(100, seed), params(3))
    list(LLM(engine).run())
    for tick in engine.ticks:
        assert len({c.request_id for c in tick.plan.chunks}) == 1
    assert shape(engine)[:5] == [
        [(0, "prefill", 0, 64)],
        [(0, "prefill", 64, 36)],
        [(0, "decode", 100, 1)],
        [(0, "decode", 101, 1)],
        [(1, "prefill", 0, 64)],
    ]


def test_cont_chunk_larger_than_prompt_means_no_split() -> None:
    engine = make_engine(chunk=4096, n_batch=2048)
    engine.add_request(prompt(1500), params(1))
    engine.step()
    assert shape(engine) == [[(0, "prefill", 0, 1500)]]


def test_all_modes_produce_identical_greedy_outputs() -> None:
    prompts = [prompt(n, n) for n in (3, 40, 130, 7, 300, 64)]
    outputs = {}
    for mode in ("seq", "static", "cont"):
        engine = make_engine(mode=mode, slots=3, chunk=32, n_batch=96)
        outputs[mode] = [r.token_ids for r in LLM(engine).generate(prompts, SamplingParams(max_tokens=12))]
    assert outputs["seq"] == outputs["static"] == outputs["cont"]
    assert any(len(o) == 12 for o in outputs["seq"])


def test_cont_reports_no_wasted_slots_when_only_the_budget_is_short() -> None:
    engine = make_engine(chunk=256, n_batch=300)
    for seed in range(3):
        engine.add_request(prompt(200, seed), params(1))
    list(LLM(engine).run())
    assert [t.plan.wasted_slots for t in engine.ticks] == [0] * len(engine.ticks)


def test_no_leftover_budget_goes_to_a_chunk_shorter_than_the_prefill_tile() -> None:
    for tile, expected_first_tick in ((1, [(0, "prefill", 0, 100), (1, "prefill", 0, 28)]),
                                      (64, [(0, "prefill", 0, 100)])):
        engine = Engine(FakeBackend(n_seq_max=4, prefill_tile=tile),
                        EngineConfig(max_slots=4, prefill_chunk_tokens=512, n_batch=128))
        engine.add_request(prompt(100, 1), params(2))
        engine.add_request(prompt(300, 2), params(2))
        engine.step()
        assert shape(engine)[0] == expected_first_tick, f"prefill tile {tile}"
        list(LLM(engine).run())
        # Every chunk reaches the tile: a tail that would be short takes tokens from the chunk before.
        chunks = [(c.request_id, c.n_tokens) for t in engine.ticks for c in t.plan.chunks
                  if c.kind is ChunkKind.PREFILL]
        assert all(n >= tile for _, n in chunks)
        if tile == 64:
            assert chunks == [(0, 100), (1, 127), (1, 109), (1, 64)]


def test_a_chunk_size_below_the_prefill_tile_still_splits_prompts() -> None:
    """The paper's small chunks (here 8 tokens) beat the tile rule; before, such prompts never started."""
    engine = Engine(FakeBackend(n_seq_max=2, prefill_tile=65),
                    EngineConfig(max_slots=2, prefill_chunk_tokens=8, n_batch=64))
    engine.add_request(prompt(20, 1), params(2))
    list(LLM(engine).run())
    chunks = [c.n_tokens for t in engine.ticks for c in t.plan.chunks if c.kind is ChunkKind.PREFILL]
    assert chunks == [8, 8, 4]


def test_the_prefill_tile_leaves_room_beside_a_full_set_of_decodes() -> None:
    """With n_batch 24 and 16 slots, 8 tokens stay free per tick: chunks shrink to them instead of waiting."""
    engine = Engine(FakeBackend(n_seq_max=16, prefill_tile=65),
                    EngineConfig(max_slots=16, prefill_chunk_tokens=512, n_batch=24))
    decoders = [engine.add_request(prompt(4, seed), params(40)) for seed in range(15)]
    late = engine.add_request(prompt(30, 99), params(2))
    list(LLM(engine).run())
    assert late.finish_time is not None and late.finish_time < min(r.finish_time for r in decoders)
