"""Values the engine hands the frontend: the loaded model's limits (ModelInfo) and a snapshot of the slots
(SlotState). With the Tokenizer (tokenizer.py), all the frontend reads of the engine: it never reaches into the
scheduler, the slot pool or the backend."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cobali.backends.base import EmbeddingLimits, TemplateSource
from cobali.engine.request import Request


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as requests are checked against it; built once, when the model has loaded."""

    n_vocab: int
    max_model_len: int  # tokens one request may hold, prompt and output (the KV accountant's seq_limit)
    context_hint: str  # how the operator gives a request more context: said with every refusal
    description: str  # the model and device, for the log
    max_slots: int  # requests decoded at once
    chat_template: TemplateSource  # the model's own; --chat-template overrides it
    embeddings: EmbeddingLimits


@dataclass(frozen=True)
class SlotState:
    """One slot as /slots shows it: taken between two ticks, on the engine's thread."""

    id: int
    request_id: int | None = None  # None: the slot is idle
    state: str = "idle"
    n_prompt_tokens: int = 0
    n_decoded: int = 0
    n_ctx_used: int = 0

    @property
    def is_processing(self) -> bool:
        return self.request_id is not None


def slot_states(running: Iterable[Request], max_slots: int) -> tuple[SlotState, ...]:
    by_slot = {r.slot: r for r in running if r.slot is not None}
    return tuple(_slot_state(slot, by_slot.get(slot)) for slot in range(max_slots))


def _slot_state(slot: int, request: Request | None) -> SlotState:
    if request is None:
        return SlotState(slot)
    return SlotState(slot, request.id, request.state.value, len(request.prompt_tokens), len(request.output_tokens),
                     request.computed_tokens)
