"""The slot pool's indexes (cobali/engine/slot_index.py): what each answers, against the plain scans they replace,
and an admission's work that does not grow with the slot count (issue 46)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

from cobali.backends.base import BackendInfo
from cobali.engine import kv
from cobali.engine.kv_blocks import KvAccountant
from cobali.engine.kv_tier import common_prefix
from cobali.engine.slot_index import CachedPrefixes, FreeSlots

ENGINE = str(Path(kv.__file__).parent)


def test_free_slots_answer_as_scans_over_every_slot_would() -> None:
    rng = random.Random(7)
    n = 37
    free, order, cached = FreeSlots(n), list(range(n)), set()  # the model: free slots in release order
    for _ in range(3000):
        slot = rng.randrange(n)
        if slot not in order:
            free.append(slot, holds := rng.random() < 0.6)
            order.append(slot)
            cached |= {slot} if holds else set()
        elif slot in cached and rng.random() < 0.2:
            free.set_empty(slot)
            cached.discard(slot)
        elif slot in cached and len(order) > 1 and rng.random() < 0.3:
            target = rng.choice([s for s in order if s != slot])
            free.hand_over(slot, target)
            order.remove(target)
            order[order.index(slot)] = target
            cached = cached - {slot} | {target}
        else:
            free.remove(slot)
            order.remove(slot)
            cached.discard(slot)
        _check(free, order, cached, n, rng)


def _check(free: FreeSlots, order: list[int], cached: set[int], n: int, rng: random.Random) -> None:
    def worth_least(slots: list[int]) -> int | None:
        empty = [s for s in slots if s not in cached]
        return min(empty) if empty else next((s for s in order if s in slots), None)

    assert len(free) == len(order) and free.in_release_order() == order
    lo, hi = sorted(rng.randrange(n + 1) for _ in range(2))
    in_span = [s for s in order if lo <= s < hi]
    assert free.any_in(range(lo, hi)) == bool(in_span)
    if in_span:
        assert free.pick((range(lo, hi), range(hi, min(hi + 1, n)))) == worth_least(
            [s for s in order if lo <= s < min(hi + 1, n)])
    if order:
        assert free.lowest() == min(order)
    empty = [s for s in order if s not in cached]
    assert free.highest_empty() == (max(empty) if empty else None)
    skip = rng.choice([None, *range(n)])
    assert free.oldest_cached(skip) == next((s for s in order if s in cached and s != skip), None)
    taken = [s for s in range(n) if s not in order]
    assert free.taken_bounds() == ((taken[0], taken[-1]) if taken else None)


def test_cached_prefixes_find_the_longest_shared_prefix_the_first_cached_of_equals() -> None:
    rng = random.Random(3)
    prefixes, model = CachedPrefixes(), dict[int, np.ndarray]()  # model: slot -> tokens, in the order cached
    alphabet = [-1, 1, 2]  # -1: all bits set, where no bytes sort after a prefix's extensions
    stems = [[rng.choice(alphabet) for _ in range(12)] for _ in range(3)]
    for _ in range(2000):
        slot = rng.randrange(24)
        if slot in model:
            assert prefixes.pop(slot) is model.pop(slot)
        else:
            tokens = np.array(rng.choice(stems)[: rng.randrange(13)] + [rng.choice(alphabet) for _ in range(4)])
            prefixes.add(slot, tokens, len(tokens) // 4)
            model[slot] = tokens
        query = np.array(rng.choice(stems)[: rng.randrange(13)] + [rng.choice(alphabet) for _ in range(3)])
        cap = rng.randrange(len(query) + 1)
        shared = {s: min(common_prefix(query, t), cap) for s, t in model.items()}
        best = max(shared.values(), default=0)
        expected = (next(s for s in model if shared[s] == best), best) if best > 0 else (None, 0)
        assert prefixes.best(query, cap) == expected
        assert prefixes.blocks == sum(len(t) // 4 for t in model.values()) and len(prefixes) == len(model)


@contextmanager
def counted_lines() -> Iterator[list[int]]:
    """Count the Python lines run in cobali/engine while inside: loops count a line per turn."""
    count = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            count[0] += 1
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(ENGINE) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield count
    finally:
        sys.settrace(previous)


def lines_per_admission(slots: int, unified: bool, mix: str, cycles: int = 12) -> float:
    """Half the slots running, the other half free with a cached prefix each, every other slot (gaps everywhere);
    a cycle releases a running slot, its KV kept, and admits a prompt of `mix`."""
    info = BackendInfo(n_vocab=96, n_ctx=512 * slots, n_ctx_seq=512 * slots if unified else 512, n_seq_max=slots,
                       n_batch=64, kv_unified=unified, description="none")
    pool = kv.SlotPool(info, slots, prefix_cache=mix != "nocache", compact=True)
    system = list(range(1000, 1032))

    def prompt(i: int) -> list[int]:
        return (system if mix == "system" else []) + [i, i + 1] * 12

    held = {pool.assign(prompt(i)).slot: prompt(i) for i in range(slots)}
    for slot in range(0, slots, 2):
        pool.release(slot, held.pop(slot) + [7] * 8)
    running = sorted(held)
    with counted_lines() as count:
        for i in range(cycles):
            ending = running[(i * 7919) % len(running)]
            kv_tokens = held.pop(ending) + [7] * 8
            pool.release(ending, kv_tokens)
            new = kv_tokens + [5] * 8 if mix == "follow" else prompt(slots + i)
            slot = pool.assign(new).slot
            held[slot] = new
            running[running.index(ending)] = slot
            pool.take_kv_ops()
    return count[0] / cycles


@pytest.mark.parametrize(("unified", "mix"), [(False, "nocache"), (False, "cold"), (False, "follow"),
                                              (False, "system"), (True, "nocache"), (True, "cold")])
def test_an_admission_runs_as_many_lines_with_4096_slots_as_with_16(unified: bool, mix: str) -> None:
    """A scan over the slots would run 256 times the lines; the indexes' trees are 12 levels deep, not 4."""
    small, large = lines_per_admission(16, unified, mix), lines_per_admission(4096, unified, mix)
    assert large < 3 * small, f"{small:.0f} lines an admission with 16 slots, {large:.0f} with 4096"


def test_the_accountant_keeps_the_blocks_it_holds_as_they_change() -> None:
    info = BackendInfo(n_vocab=96, n_ctx=4096, n_ctx_seq=4096, n_seq_max=8, n_batch=64, kv_unified=True,
                       description="none")
    acc, rng = KvAccountant(info, 8), random.Random(5)
    for _ in range(500):
        a, b, what = rng.randrange(8), rng.randrange(8), rng.random()
        if what < 0.5:
            acc.hold(a, rng.randrange(200))
        elif what < 0.75:
            acc.drop(a)
        else:
            acc.move(a, b)
        assert acc.used_blocks == sum(acc.held_blocks(s) for s in range(8))
