"""Prefixes kept in host memory once their slot is needed, and the executor of the plan's KV operations.

A free slot's cached prefix is lost when a request that reuses none of it takes the slot. With this tier its KV
is first copied to host memory, and a later prompt sharing it restores it into an empty slot instead of
prefilling it again: on 2 cores, SmolLM2-135M's 400-token prompt saves in ~7 ms (22.5 KiB a token) and restores
in ~1 ms, against 1.2 s of prefill. llama-server keeps prompts the same way (--cache-ram). The index is host
state, decided while planning; the bytes stay with the runner, on the thread that runs the KV operations.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from cobali.backends.base import Backend, BackendInfo
from cobali.engine.plan import ClearSlot, CopyPrefix, ForgetSaved, KvOp, LoadSlot, MoveSlot, SaveSlot, TrimSlot


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class HostPrefixes:
    """Token sequences whose KV is saved in host memory, least recently used first, within a token budget."""

    def __init__(self, capacity_tokens: int, head_tokens: int) -> None:
        assert capacity_tokens > 0 and head_tokens > 0
        self.capacity_tokens = capacity_tokens
        # A reuse shorter than this is worth nothing, so entries are grouped by their first head_tokens tokens.
        self.head_tokens = head_tokens
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()
        self._by_head: dict[bytes, set[int]] = {}
        self._keys = itertools.count()
        self.held_tokens = 0
        self.hit_tokens = 0  # prompt tokens restored from host memory

    @classmethod
    def sized(cls, info: BackendInfo, mib: int, head_tokens: int) -> HostPrefixes | None:
        """A tier of `mib` MiB of the backend's KV; None if that is nothing or the backend cannot save KV."""
        if mib <= 0 or info.kv_bytes_per_token <= 0:
            return None
        return cls(max(1, mib * 2**20 // info.kv_bytes_per_token), head_tokens)

    def __len__(self) -> int:
        return len(self._entries)

    def _head(self, tokens: np.ndarray) -> bytes:
        return tokens[: self.head_tokens].tobytes()

    def best(self, tokens: np.ndarray, cap: int, max_len: int) -> tuple[int | None, int]:
        """The entry sharing the longest prefix with `tokens` (counted up to `cap`), among the entries of at
        most max_len tokens (a restore fills the whole entry before it is trimmed). It becomes the most recently
        used: the slot a restore empties may save its own prefix, which must not forget the one to restore."""
        best, best_len = None, 0
        for key in self._by_head.get(self._head(tokens), ()):
            held = self._entries[key]
            if len(held) <= max_len:
                n = min(common_prefix(tokens, held), cap)
                if n > best_len:
                    best, best_len = key, n
        if best is not None:
            self._entries.move_to_end(best)
        return best, best_len

    def save(self, slot: int, tokens: np.ndarray) -> list[KvOp]:
        """What keeps `tokens`, the KV of `slot` about to be dropped, in host memory: nothing when an entry holds
        them already; else a SaveSlot, and a ForgetSaved for each entry they extend (a chat's earlier turn) and
        for the least recently used ones past the budget."""
        if len(tokens) < self.head_tokens or len(tokens) > self.capacity_tokens:
            return []
        head = self._head(tokens)
        shared = {key: common_prefix(tokens, self._entries[key]) for key in self._by_head.get(head, ())}
        for key, n in shared.items():
            if n == len(tokens):
                self._entries.move_to_end(key)
                return []
        key = next(self._keys)
        ops: list[KvOp] = [SaveSlot(slot, key)]
        ops += [self._forget(k) for k, n in shared.items() if n == len(self._entries[k])]
        self._entries[key] = tokens
        self._by_head.setdefault(head, set()).add(key)
        self.held_tokens += len(tokens)
        while self.held_tokens > self.capacity_tokens:  # never the new entry: it is the newest and fits alone
            ops.append(self._forget(next(iter(self._entries))))
        return ops

    def forget_all(self) -> list[KvOp]:
        return [self._forget(key) for key in list(self._entries)]

    def _forget(self, key: int) -> ForgetSaved:
        tokens = self._entries.pop(key)
        head = self._head(tokens)
        group = self._by_head[head]
        group.discard(key)
        if not group:
            del self._by_head[head]
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
