"""What the scheduler decides for one tick, as immutable data the engine executes: KV operations on slots,
then one batch of decode rows and prefill chunks."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple


class ChunkKind(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


class Chunk(NamedTuple):
    """A NamedTuple, not a dataclass: a tick makes one per decode row, and a tuple is built faster."""

    request_id: int
    slot: int
    kind: ChunkKind
    start: int  # position of the chunk's first token
    n_tokens: int
    context_tokens: int  # tokens the request needs in KV before it samples
    yields_token: bool  # the chunk's last row wants logits: the request samples a token this tick

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass(frozen=True)
class ClearSlot:
    """Drop everything the slot's sequence holds in KV."""

    slot: int


@dataclass(frozen=True)
class TrimSlot:
    """Keep the first `keep` tokens of the slot's KV (a cached prefix the next request shares), drop the rest."""

    slot: int
    keep: int


@dataclass(frozen=True)
class CopyPrefix:
    """Give an empty slot the first n_tokens of another slot's KV (a prefix its new request shares)."""

    source: int
    slot: int
    n_tokens: int


@dataclass(frozen=True)
class MoveSlot:
    """Move a running request's KV from `source` into the empty `slot`, leaving `source` empty."""

    source: int
    slot: int


@dataclass(frozen=True)
class SaveSlot:
    """Copy the slot's KV to host memory under `key` (a cached prefix about to be dropped from its slot)."""

    slot: int
    key: int


@dataclass(frozen=True)
class LoadSlot:
    """Fill the empty slot with the KV saved under `key`, and keep its first `keep` tokens."""

    key: int
    slot: int
    keep: int


@dataclass(frozen=True)
class ForgetSaved:
    """Free the host memory of the KV saved under `key`."""

    key: int


KvOp = ClearSlot | TrimSlot | CopyPrefix | MoveSlot | SaveSlot | LoadSlot | ForgetSaved


@dataclass(frozen=True)
class Plan:
    """One tick as the scheduler planned and committed it: its requests already count its rows in their KV
    and a stand-in for each token it samples (Request.advance)."""

    tick: int
    chunks: tuple[Chunk, ...]
    admitted: tuple[int, ...] = ()
    wasted_slots: int = 0  # free slots the admission policy kept from waiting requests this tick
    preempted: tuple[int, ...] = ()
    kv_ops: tuple[KvOp, ...] = ()  # run in order before the batch: slots released, reused, handed out
    # Tokens guessed behind decode rows (engine/spec.py), by request id: such a decode chunk has 1 + len rows.
    drafts: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    lora: int = 0  # the LoRA adapter every row of the batch runs with (0: none): llama.cpp sets one per decode
    start: float = field(default=0.0, compare=False)  # when it was planned, on the engine's clock
    n_running: int = 0  # requests holding a slot once it was planned
    n_waiting: int = 0  # requests queued once it was planned

    @cached_property
    def rows(self) -> tuple[Chunk, ...]:
        """The chunks in batch-row order, by slot (= seq_id); `chunks` keeps the scheduling priority order.
        With per-sequence KV streams llama.cpp cuts a batch into micro-batches of consecutive seq_ids, so
        any other order multiplies the graph runs, and a shuffled decode costs more than a sorted one."""
        return tuple(sorted(self.chunks, key=lambda c: c.slot))

    @property
    def slot_runs(self) -> int:
        """Runs of consecutive slots among the rows: with per-sequence KV streams, the forward passes llama.cpp
        runs over one row of each (a prefill chunk's other rows may take more)."""
        slots = sorted({c.slot for c in self.chunks})
        return sum(b != a + 1 for a, b in itertools.pairwise(slots)) + bool(slots)

    @property
    def n_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks)

    @property
    def n_decode(self) -> int:
        return sum(c.kind is ChunkKind.DECODE for c in self.chunks)

    @property
    def n_prefill_tokens(self) -> int:
        return sum(c.n_tokens for c in self.chunks if c.kind is ChunkKind.PREFILL)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    def describe(self) -> str:
        prefills = [c for c in self.chunks if c.kind is ChunkKind.PREFILL]
        parts = ", ".join(f"req {c.request_id}: [{c.start}..{c.end}) of {c.context_tokens}" for c in prefills)
        detail = f" ({parts})" if parts else ""
        return f"{self.n_decode} decode + {len(prefills)} prefill{detail} = {self.n_tokens} tok"


@dataclass(frozen=True)
class TickRecord:
    plan: Plan
    decode_start: float
    decode_end: float
    end: float

    @property
    def start(self) -> float:
        return self.plan.start

    @property
    def n_running(self) -> int:
        return self.plan.n_running

    @property
    def n_waiting(self) -> int:
        return self.plan.n_waiting

    @property
    def decode_s(self) -> float:
        return self.decode_end - self.decode_start

    @property
    def host_s(self) -> float:
        return (self.end - self.start) - self.decode_s
