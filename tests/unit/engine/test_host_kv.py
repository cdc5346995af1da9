"""The host-memory tier of the prefix cache: prefixes evicted from their slots are saved, restored, forgotten."""

from __future__ import annotations

import numpy as np
import pytest

from cobali.backends.fake import FakeBackend
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv_tier import HostPrefixes, common_prefix
from cobali.engine.plan import ForgetSaved, LoadSlot, SaveSlot
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM

ONE = SamplingParams(max_tokens=1)
MIB_TOKENS = 64  # the fake's KV is sized so that one MiB of host memory holds this many tokens


def make_engine(slots: int = 2, host_mib: int = 8192, unified_cells: int | None = None, **config) -> Engine:
    backend = FakeBackend(n_seq_max=slots, n_batch=128, kv_bytes_per_token=2**20 // MIB_TOKENS,
                          kv_unified=unified_cells is not None, n_ctx_seq=unified_cells or 4096)
    return Engine(backend, EngineConfig(max_slots=slots, n_batch=128, prefill_chunk_tokens=64,
                                        host_cache_mib=host_mib, **config))


def prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 90 for i in range(n)]


def send(engine: Engine, tokens: list[int], params: SamplingParams = ONE) -> int:
    """The prompt tokens the request found cached."""
    [request] = LLM(engine).generate([tokens], params)
    return request.cached_tokens


def saved(engine: Engine) -> list[np.ndarray]:
    """What the runner holds in host memory, decoded (the fake saves a sequence as its tokens)."""
    return list(engine._executor.kv._saved.values())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_prefix_evicted_from_its_slot_is_restored_and_generates_the_same(async_scheduling: bool) -> None:
    prompts = [prompt(30, s) for s in range(4)]
    long = SamplingParams(max_tokens=8, ignore_eos=True)
    engine = make_engine(async_scheduling=async_scheduling)
    first = LLM(engine).generate([prompts[0]], long)[0].token_ids
    assert [send(engine, p) for p in prompts[1:]] == [0, 0, 0], "two slots: the first prompt's slot is taken"
    assert prompts[0] not in [engine._backend.kv[s][:30] for s in range(2)]
    [again] = LLM(engine).generate([prompts[0]], long)
    assert again.cached_tokens == 29, "all but the last prompt token, from host memory"
    assert again.token_ids == first
    assert engine._slots.host.hit_tokens == 29 and engine._slots.hit_tokens == 29
    off = make_engine(host_mib=0)
    assert [send(off, p) for p in prompts + prompts[:1]] == [0] * 5, "without the tier it is prefilled again"


def test_the_tier_keeps_to_its_budget_least_recently_used_first_and_frees_what_it_forgets() -> None:
    engine = make_engine(host_mib=1)  # 64 tokens: two 30-token prefixes (one output token is never decoded)
    prompts = [prompt(30, s) for s in range(6)]
    for p in prompts:
        send(engine, p)
    host = engine._slots.host
    assert host.held_tokens == 60 and len(host) == 2
    assert sorted(s[:30].tolist() for s in saved(engine)) == sorted(prompts[2:4])
    assert engine._executor.kv.saved_bytes == sum(s.nbytes for s in saved(engine))
    assert send(engine, prompts[0]) == 0, "forgotten"
    assert send(engine, prompts[3]) == 29


def test_a_longer_turn_of_a_chat_replaces_its_earlier_turn_in_host_memory() -> None:
    engine = make_engine()
    turn = prompt(30, 1)
    send(engine, turn)
    send(engine, prompt(30, 2))
    send(engine, prompt(30, 3))  # the first turn goes to host memory
    assert len(engine._slots.host) == 1
    assert send(engine, turn + prompt(10, 4)) == 30, "its prompt and output"
    send(engine, prompt(30, 5))
    send(engine, prompt(30, 6))
    assert [len(s) for s in saved(engine)] == [30, 30, 40], "the second turn, not the first beside it"
    assert send(engine, turn) == 29


def test_a_prefix_held_in_host_memory_and_in_a_slot_is_saved_once() -> None:
    engine = make_engine()
    a = prompt(30, 1)
    send(engine, a)
    send(engine, prompt(30, 2))
    send(engine, prompt(30, 3))  # a goes to host memory
    send(engine, a)  # restored into a slot
    send(engine, prompt(30, 4))
    send(engine, prompt(30, 5))  # its slot taken again: host memory already holds it
    saves = [op for t in engine.ticks for op in t.plan.kv_ops if isinstance(op, SaveSlot)]
    assert len(saves) == 3 and sorted(len(s) for s in saved(engine)) == [30, 30, 30]


def test_a_unified_pool_restores_only_what_its_free_cells_can_take_whole() -> None:
    """A restore fills the whole saved prefix before trimming it to what the prompt shares."""
    engine = make_engine(unified_cells=128)
    long = prompt(100, 1)
    send(engine, long)
    send(engine, prompt(60, 2))  # long's prefix leaves its cells for this one: to host memory
    assert [len(s) for s in saved(engine)] == [100]
    assert send(engine, long[:40] + prompt(20, 3)) == 0, "100 saved cells do not fit beside the cached 60"
    assert send(engine, long[:50], SamplingParams(max_tokens=60)) == 49, "once both cached prefixes are evicted"


def test_dropping_the_cached_prefixes_forgets_those_in_host_memory() -> None:
    engine = make_engine()
    for s in range(4):
        send(engine, prompt(30, s))
    assert len(engine._slots.host) == 2
    engine._slots.drop_cached_prefixes()
    ops = engine._slots.take_kv_ops()
    assert not any(isinstance(op, SaveSlot) for op in ops) and sum(isinstance(op, ForgetSaved) for op in ops) == 2
    engine._executor.kv.run(ops)
    assert len(engine._slots.host) == 0 and engine._executor.kv.saved_bytes == 0 and not saved(engine)


def test_host_prefixes_match_within_room_and_never_forget_the_entry_just_saved() -> None:
    host = HostPrefixes(capacity_tokens=50, min_tokens=4)
    a, b = np.arange(1, 31, dtype=np.int32), np.arange(100, 140, dtype=np.int32)
    assert host.save(0, a) == [SaveSlot(0, 0)]
    assert host.best(np.concatenate([a[:20], b]), cap=59, max_len=30) == (0, 20)
    assert host.best(a, cap=29, max_len=29) == (None, 0), "30 saved tokens do not fit in 29 cells"
    assert host.save(1, b) == [SaveSlot(1, 1), ForgetSaved(0)], "30 + 40 tokens exceed 50: the oldest goes"
    assert host.save(0, np.arange(1, 61, dtype=np.int32)) == [], "larger than the whole budget: not saved"
    assert host.best(b, cap=39, max_len=100) == (1, 39) and len(host) == 1


def test_a_restore_is_planned_after_the_slot_it_fills_is_emptied() -> None:
    engine = make_engine()
    prompts = [prompt(30, s) for s in range(3)]
    for p in prompts:
        send(engine, p)
    engine.add_request(prompts[0], ONE)
    engine.take_submissions(engine.clock())
    plan = engine._scheduler.schedule(engine.clock())
    kinds = [type(op).__name__ for op in plan.kv_ops]
    assert kinds == ["SaveSlot", "ClearSlot", "LoadSlot"], kinds
    load = plan.kv_ops[-1]
    assert isinstance(load, LoadSlot) and load.keep == 29 and load.slot == plan.kv_ops[0].slot


def test_an_idle_engine_saves_its_cached_prefixes_ahead_so_a_later_request_waits_for_no_save() -> None:
    engine = make_engine()
    a, b = prompt(30, 1), prompt(30, 2)
    send(engine, a)
    send(engine, b)
    assert [engine.save_a_cached_prefix() for _ in range(3)] == [True, True, False]
    assert [s.tolist() for s in saved(engine)] == [a, b], "the least recently released first"
    engine.ticks.clear()
    assert send(engine, prompt(30, 3)) == 0
    assert not any(isinstance(op, SaveSlot) for t in engine.ticks for op in t.plan.kv_ops), "a's slot: a is saved"
    assert send(engine, a) == 29


def test_host_prefixes_find_the_longest_shared_prefix_as_a_scan_of_every_entry_would() -> None:
    """Lookups read only the neighbours of where a prompt sorts; a scan of every entry is the reference."""
    rng = np.random.default_rng(3)
    host = HostPrefixes(capacity_tokens=4000, min_tokens=2)

    def sequence() -> np.ndarray:  # three letters: long shared prefixes, prefixes of one another
        return rng.integers(1, 4, size=int(rng.integers(2, 40))).astype(np.int32)

    for _ in range(300):
        host.save(0, sequence())
        entries = list(host._entries.values())
        query, cap, max_len = sequence(), int(rng.integers(1, 40)), int(rng.integers(2, 45))
        expected = max((min(common_prefix(query, e), cap) for e in entries if len(e) <= max_len), default=0)
        key, n = host.best(query, cap, max_len)
        assert n == expected and (key is None) == (expected == 0)
    entries = list(host._entries.values())
    assert not any(len(a) < len(b) and common_prefix(a, b) == len(a) for a in entries for b in entries)
    assert host.held_tokens == sum(map(len, entries)) <= 4000


def test_a_prefix_trimmed_in_place_for_a_prompt_sharing_part_of_it_keeps_its_tail_in_host_memory() -> None:
    engine = make_engine(slots=1)
    doc = prompt(30, 1)
    a, b = doc + prompt(20, 2), doc + prompt(20, 3)
    send(engine, a)
    assert send(engine, b) == 30, "b reuses the shared 30 tokens in a's slot, trimming a's tail"
    assert send(engine, a) == 49, "a's tail was saved before the trim"



def test_an_idle_engine_whose_cached_prefixes_outgrow_the_tier_saves_what_fits_and_stops() -> None:
    """Two 40-token prefixes in a 64-token tier: saving the second would forget the first, still in its slot, and
    saving that again would forget the second: an idle server would copy KV for ever."""
    engine = make_engine(host_mib=1)
    a, b = prompt(40, 1), prompt(40, 2)
    send(engine, a)
    send(engine, b)
    saves = 0
    while engine.save_a_cached_prefix() and saves < 10:
        saves += 1
    assert saves == 1 and [s.tolist() for s in saved(engine)] == [a], "the least recently released, then no more"
    engine.ticks.clear()
    assert send(engine, prompt(40, 3)) == 0
    assert not any(isinstance(op, SaveSlot) for t in engine.ticks for op in t.plan.kv_ops), "a's slot: a is saved"


def test_taking_a_slot_for_a_restore_never_forgets_the_prefix_it_restores() -> None:
    """A 64-token tier holds a; the slot a restore takes holds b, whose save would need a's room. b is lost,
    a restored: forgetting a to keep b would prefill a again."""
    engine = make_engine(host_mib=1)
    a, b = prompt(40, 1), prompt(40, 2)
    send(engine, a)
    send(engine, b)
    assert send(engine, prompt(40, 3)) == 0, "a's slot: a to host memory"
    assert [s.tolist() for s in saved(engine)] == [a]
    assert send(engine, a) == 39, "into b's slot"
    assert [s.tolist() for s in saved(engine)] == [a] and engine._slots.host.pinned is None


def test_the_saves_a_host_tier_would_forget_are_those_save_forgets() -> None:
    host = HostPrefixes(capacity_tokens=50, min_tokens=4)
    a, b, c = np.arange(1, 21, dtype=np.int32), np.arange(100, 120, dtype=np.int32), np.arange(200, 230)
    host.save(0, a)
    host.save(1, b)
    assert host.would_forget(a[:10]) == [], "held already"
    assert host.would_forget(np.concatenate([b, c[:5]])) == [], "replaces b: 45 tokens"
    assert host.would_forget(c) == [0]
    host.pinned = 0
    assert host.save(2, c) == [], "a save that would forget the pinned entry is not made"
    host.pinned = None
    assert host.save(2, c) == [SaveSlot(2, 2), ForgetSaved(0)]
