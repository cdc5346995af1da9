"""KV memory on the host side: slots (backend sequence ids) and prefix reuse (block accounting: kv_blocks.py).

A slot is one backend sequence. The pool only decides: what must happen to a slot's KV (cleared, trimmed to a
prefix, filled with another slot's prefix, saved to or restored from host memory) is recorded as KvOps, which
the scheduler puts in the tick's plan and the engine runs before the decode. With per-sequence streams
(llama.cpp's default here) each slot owns n_ctx_seq cells and no slot can take another's; with a unified KV
all slots draw on one pool of n_ctx cells, and the accountant is what keeps the pool from running dry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cobali.backends.base import BackendInfo
from cobali.engine.kv_blocks import BLOCK_TOKENS, KvAccountant
from cobali.engine.kv_tier import KEY_DTYPE, HostPrefixes, common_prefix
from cobali.engine.plan import ClearSlot, CopyPrefix, KvOp, LoadSlot, MoveSlot, TrimSlot
from cobali.engine.slot_index import CachedPrefixes, FreeSlots


@dataclass(frozen=True)
class Assignment:
    slot: int
    reused_tokens: int  # prompt tokens already in the slot's KV: prefill starts after them


class SlotPool:
    """Free slots in least-recently-released order. With prefix caching a released slot keeps its KV
    until it is reused or evicted (to host_mib MiB of host memory, if any), and a new request starts from the
    longest cached prefix it shares. An admission or a release costs O(log max_slots) (slot_index.py), but for a
    min() in C over the cached slots that share as much with its prompt as the best one."""

    def __init__(self, info: BackendInfo, max_slots: int, prefix_cache: bool = False,
                 min_reuse_tokens: int = BLOCK_TOKENS, compact: bool = False,
                 host_mib: int = 0) -> None:
        if not 1 <= max_slots <= info.n_seq_max:
            raise ValueError(f"max_slots must be in [1, {info.n_seq_max}], got {max_slots}")
        self.max_slots = max_slots
        self.prefix_cache = prefix_cache
        self.min_reuse_tokens = min_reuse_tokens
        self.host = HostPrefixes.sized(info, host_mib, min_reuse_tokens) if prefix_cache else None
        self.accountant = KvAccountant(info, max_slots)
        # Only per-sequence streams split a batch by seq_id runs; a unified KV runs any rows in one pass.
        self.compacts = compact and not self.accountant.unified
        self._free = FreeSlots(max_slots)
        self._no_gap = True  # no slot was taken or freed since fill_gap last found no gap (skips its search)
        self._cached = CachedPrefixes()  # free slot -> tokens its KV still holds
        self._ops: list[KvOp] = []  # decided, not yet run by the engine
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def n_free(self) -> int:
        return len(self._free)

    def take_kv_ops(self) -> tuple[KvOp, ...]:
        """The KV operations decided since the last call, in order; the caller must run them all."""
        ops, self._ops = tuple(self._ops), []
        return ops

    def can_assign(self) -> bool:
        return bool(self._free)

    @property
    def cached_blocks(self) -> int:
        return self._cached.blocks

    def assign(self, prompt: list[int] | None = None,
               sources: Iterable[tuple[int, np.ndarray]] | None = None) -> Assignment:
        """Take a free slot for a request. With prefix caching, start from the longest prefix of `prompt`
        held by a cached free slot, by a running slot in `sources` ((slot, tokens in its KV) pairs, read
        lazily: the search stops at the first source holding all it could reuse), or in host memory."""
        assert self._free, "no free slot"
        if not (self.prefix_cache and prompt):
            slot = self._take_fresh()
            return Assignment(slot, 0)
        tokens = np.asarray(prompt, dtype=KEY_DTYPE)
        source, reused = self._best_source(tokens, sources or ())
        self.queried_tokens += len(tokens)
        if reused < self.min_reuse_tokens:
            source, reused = None, 0
        keeping = self._slots_keeping_runs() if self.compacts else None  # None: any free slot keeps them
        if self.host is not None and (match := self._host_match(tokens, reused)[0]) is not None:
            self.host.keep(match)  # the save that taking a slot may make then forgets others first, never it
            self.host.pinned = match
            slot = self._take_fresh(keeping=keeping)
            self.host.pinned = None
            # Looked up again: taking the slot may have saved its own prefix and forgotten older ones.
            key, reused = self._host_match(tokens, 0)
            if key is not None:
                self.host.hit_tokens += reused
                self._ops.append(LoadSlot(key, slot, reused))
        elif source is not None and source in self._free and (keeping is None or any(source in k for k in keeping)):
            slot = source  # the prefix is already in this very slot: keep it, drop the rest (to host memory first)
            if self.host is not None and reused < len(self._cached[slot]):
                self._ops += self.host.save(slot, self._cached[slot])
            self._free.remove(slot)
            self._no_gap = False
            self._ops.append(TrimSlot(slot, reused))
            self._cached.pop(slot)
        else:
            slot = self._take_fresh(keep=source, keeping=keeping)
            if source is not None:
                self._ops.append(CopyPrefix(source, slot, reused))
        self.hit_tokens += reused
        return Assignment(slot, reused)

    def _host_match(self, tokens: np.ndarray, beyond: int) -> tuple[int | None, int]:
        """The host entry sharing the most of `tokens`, if more than `beyond` and min_reuse_tokens; only those
        the KV can take whole before the trim: any in a stream of its own, in a unified pool its free cells."""
        if self.host is None:
            return None, 0
        acc = self.accountant
        room = acc.free_blocks * acc.block_tokens if acc.unified else acc.seq_limit
        key, n = self.host.best(tokens, len(tokens) - 1, room)
        return (key, n) if n > max(beyond, self.min_reuse_tokens - 1) else (None, 0)

    def _take_fresh(self, keep: int | None = None, keeping: tuple[range, ...] | None = None) -> int:
        """A free slot for a request that reuses none of its KV. With per-sequence streams llama.cpp runs one
        forward pass per run of consecutive seq_ids among a batch's rows, so a slot that keeps the taken ones
        one run (compacting: a gap between them first, else one beside them), else the lowest free one. With a
        unified KV any slot costs the same. Among those, the one whose cached prefix is worth least: the lowest
        holding none, else the least recently released; the cached prefixes of the other free slots stay for the
        requests that come back to them (a chat's next turn), as many as there are free slots. `keep`: a slot
        whose prefix the request is about to copy; `keeping`: the run-keeping slots, if already found."""
        if self.accountant.unified:
            slot = self._free.pick((range(self.max_slots),))
        elif self.compacts:
            slot = self._free.pick(keeping if keeping is not None else self._slots_keeping_runs())
        else:
            slot = self._free.lowest()
        self._take(slot, keep)
        return slot

    def _take(self, slot: int, keep: int | None = None) -> None:
        """Take free `slot`, emptied. Compacting, a cached prefix in it moves to a free slot worth less (the
        highest holding none, else one released before it; never `keep`) and keeps its place in the release
        order: the cache then loses its least recently released prefix, not the one that happened to sit
        where the running slots grow (one stream copy, bench/engine/kv_streams.py)."""
        target = self._spare_slot(slot, keep) if self.compacts and slot in self._cached else None
        if target is None:
            self._free.remove(slot)
            self._clear(slot)
        else:
            self._clear(target)
            self._free.hand_over(slot, target)
            self._ops.append(MoveSlot(slot, target))
            self.accountant.move(slot, target)
            self._cached.add(target, self._cached[slot], self.accountant.held_blocks(target))
            self._cached.pop(slot)
        self._no_gap = False

    def _spare_slot(self, slot: int, keep: int | None) -> int | None:
        """Where `slot`'s cached prefix may go: a free slot holding none (the highest, away from where runs
        start), else the least recently released, if before it; never `keep`. None: it is the least recently
        released."""
        empty = self._free.highest_empty()
        if empty is not None:
            assert empty not in (slot, keep), "a slot to take or to copy from holds a prefix"
            return empty
        oldest = self._free.oldest_cached(skip=keep)
        return None if oldest == slot else oldest

    def _slots_keeping_runs(self) -> tuple[range, ...]:
        """The free slots a request may take without adding a run of taken ones: the gaps between them, else
        the slots either side; every free slot while none is taken."""
        bounds = self._free.taken_bounds()
        if bounds is None:
            return (range(self.max_slots),)
        lo, hi = bounds
        if self._free.any_in(gaps := range(lo + 1, hi)):
            return (gaps,)
        return tuple(range(s, s + 1) for s in (lo - 1, hi + 1) if 0 <= s < self.max_slots)

    @property
    def may_have_gap(self) -> bool:
        return self.compacts and not self._no_gap

    def fill_gap(self, slot: int) -> int | None:
        """Move the running request in `slot`, the highest taken one, into a free slot between the taken ones
        (the one whose cached prefix is worth least), so that they form fewer runs. None: they form one already."""
        assert self.compacts
        bounds = self._free.taken_bounds()
        assert bounds is not None and bounds[1] == slot, f"slot {slot} is not the highest taken one"
        gaps = range(bounds[0] + 1, slot)
        if not self._free.any_in(gaps):
            self._no_gap = True
            return None
        dst = self._free.pick((gaps,))
        self._take(dst)
        self._ops.append(MoveSlot(slot, dst))
        self.accountant.move(slot, dst)
        self._free.append(slot, cached=False)
        return dst

    def _best_source(self, tokens: np.ndarray, sources: Iterable[tuple[int, np.ndarray]]) -> tuple[int | None, int]:
        cap = len(tokens) - 1  # at least the prompt's last token must be computed, for its logits
        best, best_len = self._cached.best(tokens, cap)
        if best_len >= cap:
            return best, best_len
        for slot, held in sources:
            n = min(common_prefix(tokens, held), cap)
            if n > best_len:
                best, best_len = slot, n
                if n == cap:
                    break
        return best, best_len

    def release(self, slot: int, kv_tokens: list[int] | None = None) -> None:
        """Give a slot back. Without prefix caching (or with nothing worth keeping) its KV is dropped at
        once; otherwise it stays, to be reused or evicted."""
        assert slot not in self._free, f"slot {slot} released twice"
        if self.prefix_cache and kv_tokens and len(kv_tokens) >= self.min_reuse_tokens:
            self.accountant.hold(slot, len(kv_tokens))
            self._cached.add(slot, np.asarray(kv_tokens, dtype=KEY_DTYPE), self.accountant.held_blocks(slot))
        else:
            self._clear(slot)
        self._free.append(slot, cached=slot in self._cached)
        self._no_gap = False

    def reusable_slot(self, prompt: list[int] | None) -> int | None:
        """The free slot whose cached prefix `prompt` would reuse in place, if any: evicting for room spares it.
        None too where host memory holds a longer one that the free slots' cells, once emptied, can take."""
        if not (self.prefix_cache and prompt):
            return None
        tokens = np.asarray(prompt, dtype=KEY_DTYPE)
        slot, reused = self._best_source(tokens, ())
        if reused < self.min_reuse_tokens:
            return None
        room = (self.accountant.free_blocks + self.cached_blocks) * self.accountant.block_tokens
        if self.host is not None and self.host.best(tokens, len(tokens) - 1, room)[1] > reused:
            return None
        return slot

    def evict_one(self, spare: int | None = None) -> bool:
        """Drop the least recently released cached prefix but `spare`'s (to free pool cells); False if none is left."""
        slot = self._free.oldest_cached(skip=spare)
        if slot is None:
            return False
        self._clear(slot)
        return True

    def save_a_cached_prefix(self) -> bool:
        """Save to host memory one cached prefix not there yet, the least recently released first; False if none
        is left. For an idle engine: a request that takes the slot later then need not wait for the save. Never
        one whose save would forget, for the budget, the saved copy of another slot's prefix: that one would be
        saved next, forgetting this one, and an idle engine would copy KV for ever."""
        if self.host is None:
            return False
        order = [slot for slot in self._free.in_release_order() if slot in self._cached]
        cached = [self._cached[slot] for slot in order]
        for slot, tokens in zip(order, cached, strict=True):
            if any(common_prefix(self.host.tokens(key), other) == len(other)
                   for key in self.host.would_forget(tokens) for other in cached):
                continue
            if ops := self.host.save(slot, tokens):
                self._ops += ops
                return True
        return False

    def drop_cached_prefixes(self) -> None:
        """Forget every cached prefix, in the slots and in host memory: nothing is reused after this."""
        for slot in [s for s in self._free.in_release_order() if s in self._cached]:
            self._clear(slot, to_host=False)
        if self.host is not None:
            self._ops += self.host.forget_all()

    def _clear(self, slot: int, to_host: bool = True) -> None:
        """Empty the slot; a cached prefix in it goes to host memory first, if there is a host tier."""
        tokens = self._cached.pop(slot)
        if tokens is not None and slot in self._free:
            self._free.set_empty(slot)  # evicted, or about to take another's prefix: free, holding none
        self.accountant.drop(slot)
        if tokens is not None and to_host and self.host is not None:
            self._ops += self.host.save(slot, tokens)
        self._ops.append(ClearSlot(slot))
