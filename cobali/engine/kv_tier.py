"""Prefixes kept in host memory once their slot is needed, and the executor of the plan's KV operations.

A free slot's cached prefix is lost when a request that reuses none of it takes the slot. With this tier its KV
is first copied to host memory, and a later prompt sharing it restores it into an empty slot instead of
prefilling it again: a save and a restore cost a small fraction of the prefill they spare (docs/results.md,
"KV management"). llama-server keeps prompts the same way (--cache-ram). The index is host
state, decided while planning; the bytes stay with the runner, on the thread that runs the KV operations.
"""

from __future__ import annotations

import bisect
import itertools
from collections import OrderedDict

import numpy as np

from cobali.backends.base import Backend, BackendInfo
from cobali.engine.plan import ClearSlot, CopyPrefix, ForgetSaved, KvOp, LoadSlot, MoveSlot, SaveSlot, TrimSlot

# The prefix cache's keys (Request.kv_key): a token's 32 bits, and above them a cache_salt's mark.
KEY_DTYPE = np.int64


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def sortable_key(tokens: np.ndarray) -> bytes:
    """Keys as bytes that sort as the sequences do (big-endian, fixed width), prefixes first."""
    return tokens.astype(">u8").tobytes()


class HostPrefixes:
    """Token sequences whose KV is saved in host memory, least recently used first, within a token budget.

    Kept sorted as sequences too: of a sorted set, the members sharing the longest prefix with any sequence sit
    beside the place it would sort, so a lookup reads a few neighbours instead of every entry (a scan grew
    with the entries sharing one long system prompt). No entry is a prefix of another:
    a longer one replaces it, and a shorter one is not saved."""

    def __init__(self, capacity_tokens: int, min_tokens: int) -> None:
        assert capacity_tokens > 0 and min_tokens > 0
        self.capacity_tokens = capacity_tokens
        self.min_tokens = min_tokens  # a shorter reuse is worth nothing
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()
        self._sorted: list[bytes] = []
        self._key_of: dict[bytes, int] = {}
        self._keys = itertools.count()
        self.held_tokens = 0
        self.hit_tokens = 0  # prompt tokens restored from host memory
        self.pinned: int | None = None  # an entry about to be restored: no save forgets it for the budget

    @classmethod
    def sized(cls, info: BackendInfo, mib: int, min_tokens: int) -> HostPrefixes | None:
        """A tier of `mib` MiB of the backend's KV; None if that is nothing or the backend cannot save KV."""
        if mib <= 0 or info.kv_bytes_per_token <= 0:
            return None
        return cls(max(1, mib * 2**20 // info.kv_bytes_per_token), min_tokens)

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, tokens: np.ndarray, cap: int, max_len: int) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with `tokens` (counted up to `cap`), among the entries of at
        most max_len tokens (a restore fills the whole entry before it is trimmed)."""
        at = bisect.bisect_left(self._sorted, sortable_key(tokens))
        best, best_len = None, 0
        for indices in (range(at - 1, -1, -1), range(at, len(self._sorted))):
            for i in indices:  # what they share with `tokens` only shrinks away from `at`
                key = self._key_of[self._sorted[i]]
                held = self._entries[key]
                n = min(common_prefix(tokens, held), cap)
                if n <= best_len:
                    break
                if len(held) <= max_len:
                    best, best_len = key, n
        return best, best_len

    def keep(self, key: int) -> None:
        """Make the entry the most recently used (one about to be restored)."""
        self._entries.move_to_end(key)

    def _place(self, tokens: np.ndarray) -> tuple[bytes, int | None, int | None]:
        """Where `tokens` would go: their sortable bytes, the entry holding them already (they are it or a prefix
        of it), and the entry they extend (a chat's earlier turn); None where there is none."""
        sortable = sortable_key(tokens)
        at = bisect.bisect_left(self._sorted, sortable)
        holder = extended = None
        if at < len(self._sorted) and self._sorted[at].startswith(sortable):  # sorts first among its extensions
            holder = self._key_of[self._sorted[at]]
        elif at > 0 and sortable.startswith(self._sorted[at - 1]):  # a prefix sorts just before what extends it
            extended = self._key_of[self._sorted[at - 1]]
        return sortable, holder, extended

    def would_forget(self, tokens: np.ndarray) -> list[int]:
        """The entries a save of `tokens` would forget to keep to the budget, least recently used first (not the
        entry they extend: they hold it)."""
        if len(tokens) < self.min_tokens or len(tokens) > self.capacity_tokens:
            return []
        _, holder, extended = self._place(tokens)
        if holder is not None:
            return []
        held = self.held_tokens + len(tokens) - (len(self._entries[extended]) if extended is not None else 0)
        forgotten = []
        for key, entry in self._entries.items():
            if held <= self.capacity_tokens:
                break
            if key != extended:
                forgotten.append(key)
                held -= len(entry)
        return forgotten

    def tokens(self, key: int) -> np.ndarray:
        return self._entries[key]

    def save(self, slot: int, tokens: np.ndarray) -> list[KvOp]:
        """What keeps `tokens`, the KV of `slot` about to be dropped, in host memory: nothing when an entry holds
        them already, or when keeping to the budget would forget the pinned entry; else a SaveSlot, a ForgetSaved
        for the entry they extend (a chat's earlier turn), if any, and one for each least recently used entry past
        the budget."""
        if len(tokens) < self.min_tokens or len(tokens) > self.capacity_tokens:
            return []
        if self.pinned is not None and self.pinned in self.would_forget(tokens):
            return []  # the entry about to be restored stays, this KV is lost
        sortable, holder, extended = self._place(tokens)
        if holder is not None:
            self._entries.move_to_end(holder)
            return []
        key = next(self._keys)
        ops: list[KvOp] = [SaveSlot(slot, key)]
        if extended is not None:
            ops.append(self._forget(extended))
        bisect.insort(self._sorted, sortable)
        self._key_of[sortable] = key
        self._entries[key] = tokens
        self.held_tokens += len(tokens)
        while self.held_tokens > self.capacity_tokens:  # never the new entry: it is the newest and fits alone
            ops.append(self._forget(next(iter(self._entries))))
        return ops

    def forget_all(self) -> list[KvOp]:
        return [self._forget(key) for key in list(self._entries)]

    def _forget(self, key: int) -> ForgetSaved:
        tokens = self._entries.pop(key)
        sortable = sortable_key(tokens)
        del self._sorted[bisect.bisect_left(self._sorted, sortable)]
        del self._key_of[sortable]
        self.held_tokens -= len(tokens)
        return ForgetSaved(key)


class KvRunner:
    """Runs the plan's KV operations on the backend, in order, and holds the KV saved to host memory. One
    thread runs them all (the engine's), so the saved bytes need no lock."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._saved: dict[int, np.ndarray] = {}
        self.saved_bytes = 0

    def run(self, ops: tuple[KvOp, ...]) -> None:
        backend = self.backend
        for op in ops:
            match op:
                case ClearSlot(slot):
                    backend.remove_seq(slot)
                case TrimSlot(slot, keep):
                    backend.remove_seq(slot, keep, -1)
                case CopyPrefix(source, slot, n_tokens):
                    # The whole sequence, then its tail dropped: llama.cpp copies between per-sequence streams
                    # only whole.
                    backend.copy_seq(source, slot, 0, -1)
                    backend.remove_seq(slot, n_tokens, -1)
                case MoveSlot(source, slot):
                    backend.copy_seq(source, slot, 0, -1)
                    backend.remove_seq(source)
                case SaveSlot(slot, key):
                    data = self._saved[key] = backend.save_seq(slot)
                    self.saved_bytes += data.nbytes
                case LoadSlot(key, slot, keep):
                    backend.load_seq(slot, self._saved[key])
                    backend.remove_seq(slot, keep, -1)
                case ForgetSaved(key):
                    self.saved_bytes -= self._saved.pop(key).nbytes
