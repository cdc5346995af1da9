"""KV slots: each slot is one backend sequence id; a request holds one while it is in flight."""

from __future__ import annotations

from collections import deque

from cobali.backends.base import Backend


class SlotPool:
    def __init__(self, backend: Backend, max_slots: int) -> None:
        if not 1 <= max_slots <= backend.info.n_seq_max:
            raise ValueError(f"max_slots must be in [1, {backend.info.n_seq_max}], got {max_slots}")
        self.backend = backend
        self.max_slots = max_slots
        self._free: deque[int] = deque(range(max_slots))

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.max_slots - len(self._free)

    def can_assign(self) -> bool:
        return bool(self._free)

    def assign(self) -> int:
        """Take a free slot with an empty KV sequence."""
        slot = self._free.popleft()
        self.backend.remove_seq(slot)
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back and drop its KV at once, so the cells are free for the next tick."""
        assert slot not in self._free, f"slot {slot} released twice"
        self.backend.remove_seq(slot)
        self._free.append(slot)
