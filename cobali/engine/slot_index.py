"""Indexes that keep the slot pool's admissions and releases from costing a scan over every slot (issue 46: with
256 slots a third of the planning time went to SlotPool.assign's scans).

FreeSlots answers which free slot a request takes: a min segment tree over the slot indices gives, over any span
of slots, the lowest free slot holding no cached prefix, else the least recently released one, in O(log n).
CachedPrefixes finds the cached prefix sharing most with a prompt: sorted as sequences, the best sits beside
where the prompt would sort (as in kv_tier.HostPrefixes).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cobali.engine.kv_tier import common_prefix, sortable_key

_TAKEN = 1 << 80  # a taken slot's leaf: above every free one's, whatever the count of releases


class _LazyHeap:
    """A min-heap whose entries go stale instead of being removed: `valid` says which still hold. Rebuilt once
    stale ones outnumber the live, so that its size, and each push, stay bounded whatever is never read."""

    def __init__(self, valid: Callable[[int], bool]) -> None:
        self._items: list[int] = []
        self._valid = valid

    def push(self, item: int, live: int) -> None:
        heapq.heappush(self._items, item)
        if len(self._items) > 2 * live + 16:
            self._items = list({i for i in self._items if self._valid(i)})  # an entry pushed twice is kept once
            heapq.heapify(self._items)

    def top(self, skip: int | None = None) -> int | None:
        """The least valid entry but `skip`."""
        items = self._items
        while items and not self._valid(items[0]):
            heapq.heappop(items)
        if not items or items[0] != skip:
            return items[0] if items else None
        skipped = heapq.heappop(items)
        try:
            return self.top()
        finally:
            heapq.heappush(items, skipped)


class FreeSlots:
    """The free slots in release order, and which of them hold a cached prefix. A leaf of the tree holds its free
    slot's index if it holds no prefix, else (1 + its place in the release order) * size + index: the least of a
    span is the lowest empty slot, else the least recently released (_TAKEN where every slot is taken). Heaps
    whose stale entries are skipped when read keep the least recently released cached slot (the least of every
    slot's is an empty one's) and the lowest and highest taken slots, in O(log n) amortized."""

    def __init__(self, n_slots: int) -> None:
        self._size = size = 1 << (n_slots - 1).bit_length()
        self._n_slots = n_slots
        self._seq: dict[int, int] = {}  # free slot -> its place in the release order
        self._next_seq = itertools.count()
        self._tree = [_TAKEN] * (2 * size)
        self._oldest_cached = _LazyHeap(lambda key: self._tree[size + key % size] == key)  # leaf keys
        self._taken_lo = _LazyHeap(lambda slot: slot not in self._seq)
        self._taken_hi = _LazyHeap(lambda neg: -neg not in self._seq)  # negated: the highest first
        for slot in range(n_slots):
            self._seq[slot] = next(self._next_seq)
            self._tree[size + slot] = slot
        for i in range(size - 1, 0, -1):
            self._tree[i] = min(self._tree[2 * i], self._tree[2 * i + 1])

    def __len__(self) -> int:
        return len(self._seq)

    def __contains__(self, slot: int) -> bool:
        return slot in self._seq

    def append(self, slot: int, cached: bool) -> None:
        """Free `slot`: the most recently released."""
        assert slot not in self._seq, f"slot {slot} released twice"
        self._seq[slot] = next(self._next_seq)
        self._set(slot, cached)

    def remove(self, slot: int) -> None:
        del self._seq[slot]
        self._set_leaf(slot, _TAKEN)
        taken = self._n_slots - len(self._seq)
        self._taken_lo.push(slot, taken)
        self._taken_hi.push(-slot, taken)

    def hand_over(self, slot: int, target: int) -> None:
        """Take `slot`; free `target` holds its cached prefix now, and its place in the release order."""
        seq = self._seq[slot]
        self.remove(slot)
        self._seq[target] = seq
        self._set(target, cached=True)

    def set_empty(self, slot: int) -> None:
        """Free `slot`'s cached prefix was dropped; it keeps its place in the release order."""
        self._set(slot, cached=False)

    def pick(self, spans: tuple[range, ...]) -> int:
        """Of the free slots in `spans` (ranges of slot indices), the lowest holding no cached prefix, else the
        least recently released."""
        least = min(self._least(span) for span in spans)
        assert least < _TAKEN, f"no free slot in {spans}"
        return least % self._size

    def any_in(self, span: range) -> bool:
        return self._least(span) < _TAKEN

    def lowest(self) -> int:
        found = self._descend(_TAKEN, rightmost=False)
        assert found is not None, "no free slot"
        return found

    def highest_empty(self) -> int | None:
        """The highest free slot holding no cached prefix, if any."""
        return self._descend(self._size, rightmost=True)

    def oldest_cached(self, skip: int | None = None) -> int | None:
        """The least recently released free slot holding a cached prefix, but `skip`."""
        key = self._oldest_cached.top(self._key(skip) if skip is not None and skip in self._seq else None)
        return None if key is None else key % self._size

    def taken_bounds(self) -> tuple[int, int] | None:
        """The lowest and the highest taken slot; None while none is."""
        lo, neg_hi = self._taken_lo.top(), self._taken_hi.top()
        return None if lo is None or neg_hi is None else (lo, -neg_hi)

    def in_release_order(self) -> list[int]:
        """Every free slot, the least recently released first: O(n log n), for the idle engine's sweeps."""
        return sorted(self._seq, key=self._seq.__getitem__)

    def _key(self, slot: int) -> int:
        """The leaf `slot` has while it holds a cached prefix."""
        return (1 + self._seq[slot]) * self._size + slot

    def _set(self, slot: int, cached: bool) -> None:
        if not cached:
            self._set_leaf(slot, slot)
            return
        key = self._key(slot)
        self._set_leaf(slot, key)
        self._oldest_cached.push(key, len(self._seq))

    def _set_leaf(self, slot: int, value: int) -> None:
        tree = self._tree
        i = self._size + slot
        tree[i] = value
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            least = left if left < right else right
            if tree[i] == least:
                break  # the nodes above hold what they held
            tree[i] = least
            i >>= 1

    def _least(self, span: range) -> int:
        tree, least = self._tree, _TAKEN
        if span.start <= 0 and span.stop >= self._n_slots:
            return tree[1]  # every slot: a unified KV's every admission
        lo, hi = span.start + self._size, span.stop + self._size
        while lo < hi:
            if lo & 1:
                least = min(least, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                least = min(least, tree[hi])
            lo, hi = lo >> 1, hi >> 1
        return least

    def _descend(self, below: int, rightmost: bool) -> int | None:
        """The lowest (or highest) slot whose leaf is less than `below`."""
        tree = self._tree
        if tree[1] >= below:
            return None
        i = 1
        while i < self._size:
            first, second = (2 * i + 1, 2 * i) if rightmost else (2 * i, 2 * i + 1)
            i = first if tree[first] < below else second
        return i - self._size


class _Cached(NamedTuple):
    tokens: np.ndarray
    blocks: int  # of KV, in the accountant's blocks
    entry: tuple[bytes, int]  # in CachedPrefixes._sorted
    order: int  # when it was cached


class CachedPrefixes:
    """The free slots' cached prefixes (slot -> tokens) and the KV blocks they hold, sorted as sequences too.
    A lookup reads the two beside where a prompt sorts, then the least of the cache orders of those sharing as
    much with it: a slice of ints, read in C, as long as the slots that share that prefix are many."""

    def __init__(self) -> None:
        self._held: dict[int, _Cached] = {}
        self._sorted: list[tuple[bytes, int]] = []  # (sortable tokens, slot)
        self._orders: list[int] = []  # beside _sorted: when each was cached
        self._slot_of: dict[int, int] = {}  # order -> slot
        self._next_order = itertools.count()
        self.blocks = 0

    def __contains__(self, slot: int) -> bool:
        return slot in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __getitem__(self, slot: int) -> np.ndarray:
        return self._held[slot].tokens

    def add(self, slot: int, tokens: np.ndarray, blocks: int) -> None:
        assert slot not in self._held
        cached = _Cached(tokens, blocks, (sortable_key(tokens), slot), next(self._next_order))
        at = bisect.bisect_left(self._sorted, cached.entry)
        self._sorted.insert(at, cached.entry)
        self._orders.insert(at, cached.order)
        self._held[slot], self._slot_of[cached.order] = cached, slot
        self.blocks += blocks

    def pop(self, slot: int) -> np.ndarray | None:
        cached = self._held.pop(slot, None)
        if cached is None:
            return None
        at = bisect.bisect_left(self._sorted, cached.entry)
        del self._sorted[at], self._orders[at], self._slot_of[cached.order]
        self.blocks -= cached.blocks
        return cached.tokens

    def best(self, tokens: np.ndarray, cap: int) -> tuple[int | None, int]:
        """The slot sharing the longest prefix with `tokens` (counted up to `cap`); of those sharing as much, the
        one cached first. (None, 0) where none shares a token."""
        entries = self._sorted
        at = bisect.bisect_left(entries, (sortable_key(tokens),))
        shared = max((min(common_prefix(tokens, self._held[entries[i][1]].tokens), cap)
                      for i in (at - 1, at) if 0 <= i < len(entries)), default=0)
        if shared <= 0:
            return None, 0
        prefix = sortable_key(tokens[:shared])  # those sharing it sort together, from where it would
        lo = bisect.bisect_left(entries, (prefix,))
        stripped = prefix.rstrip(b"\xff")  # the least bytes above every extension of the prefix: it, last one + 1
        hi = bisect.bisect_left(entries, (stripped[:-1] + bytes([stripped[-1] + 1]),), lo) if stripped else len(entries)
        return self._slot_of[min(self._orders[lo:hi])], shared
