"""KV cells counted in blocks per slot, against what the backend really has: what admission and preemption ask."""

from __future__ import annotations

from cobali.backends.base import BackendInfo

BLOCK_TOKENS = 16


class KvAccountant:
    """Blocks of BLOCK_TOKENS cells per slot, over the backend's real capacity."""

    def __init__(self, info: BackendInfo, max_slots: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.block_tokens = block_tokens
        self.unified = info.kv_unified
        cells = info.n_ctx if info.kv_unified else info.n_ctx_seq * max_slots
        self.total_blocks = cells // block_tokens
        # Cells one sequence may ever hold: its stream, or as much of the pool as whole blocks cover.
        self.seq_limit = min(info.n_ctx_seq, self.total_blocks * block_tokens) if self.unified else info.n_ctx_seq
        self._held: dict[int, int] = {}
        self._used = 0  # the sum of _held, kept as it changes: each admission asks it, often
        self._cells, self._slots = cells, max_slots

    def context_hint(self) -> str:
        """How the operator gives one request more context, in the faces' flags: said with every refusal."""
        if self.unified:
            return f"the KV pool has {self._cells} cells: start with a larger --ctx (or --fit)"
        return (f"the {self._cells} KV cells are split over {self._slots} slots: start with a larger --ctx, fewer "
                "--max-slots, --kv-unified (one pool a request may fill), or --fit")

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_tokens)

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def fits_ever(self, n_tokens: int) -> bool:
        return n_tokens <= self.seq_limit

    def can_hold(self, slot: int | None, n_tokens: int) -> bool:
        """Could `slot` (None: a slot still to be assigned) hold n_tokens cells?"""
        if not self.fits_ever(n_tokens):
            return False
        if not self.unified:
            return True  # a stream is the slot's own; fits_ever already said it is big enough
        held = self._held.get(slot, 0) if slot is not None else 0
        return self.used_blocks - held + self.blocks_for(n_tokens) <= self.total_blocks

    def hold(self, slot: int, n_tokens: int) -> None:
        blocks = self.blocks_for(n_tokens)
        self._used += blocks - self._held.get(slot, 0)
        self._held[slot] = blocks

    def held_blocks(self, slot: int) -> int:
        return self._held.get(slot, 0)

    def held_tokens(self, slot: int) -> int:
        return self.held_blocks(slot) * self.block_tokens

    def drop(self, slot: int) -> None:
        self._used -= self._held.pop(slot, 0)

    def move(self, source: int, slot: int) -> None:
        moved = self._held.pop(source, 0)
        self._used -= self._held.get(slot, 0)
        self._held[slot] = moved
