"""The engine's settings, typed and frozen: checked once, where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field

from cobali.backends.base import BackendInfo
from cobali.engine.budget import check_budget_settings
from cobali.engine.policies import admission_for_mode, batch_policy, kv_policy
from cobali.engine.queue import WaitQueue
from cobali.engine.speculative import SpecConfig
from cobali.structured.limits import GrammarLimits


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "cont"
    max_slots: int = 16
    prefill_chunk_tokens: int = 512
    n_batch: int = 512
    policy: str = "decode-max"
    # reserve: it ran faster than optimistic on a tight unified pool (docs/results.md, "KV management"); with
    # per-sequence streams the two admit the same.
    kv_admission: str = "reserve"
    queue: str = "fifo"
    prefix_cache: bool = True
    # Host memory for cached prefixes dropped from their slots, restored instead of prefilled again (0: none).
    # llama-server's --cache-ram default.
    host_cache_mib: int = 8192
    # Per-sequence KV streams: keep the running requests in one run of slots, moving one into a gap a tick
    # (llama.cpp runs a forward pass per run of consecutive seq_ids).
    compact_slots: bool = True
    # Per-sequence KV streams: prompt chunks join a tick only where llama.cpp still runs it in two forward passes
    # (engine/policies.py, TwoPassTicks); off: every chunk the budget allows. Off by default until its cost to
    # prefill throughput is measured (docs/results.md, "Passes per tick").
    two_pass_ticks: bool = False
    itl_target_ms: float = 0.0  # > 0: adaptive tick budget from a cost profile; 0: fixed n_batch
    tpot_slo_ms: float = 0.0  # > 0: the deadline budget (engine/budget.py), bounded by itl_max_ms (0: none)
    itl_max_ms: float = 0.0
    record_ticks: bool = True
    # Plan and fill tick t+1 while tick t's decode runs (engine/overlap.py). For a backend whose decode leaves
    # the host's cores idle (a GPU); on a CPU backend the host work would compete with the kernels' threads.
    async_scheduling: bool = False
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding by prompt lookup (off by default)
    lora_updates: bool = False  # LoRA adapters may be loaded while serving (Engine.adapters)
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # what one constraint may cost

    def __post_init__(self) -> None:
        admission_for_mode(self.mode, self.prefill_chunk_tokens)
        batch_policy(self.policy)
        kv_policy(self.kv_admission)
        WaitQueue(self.queue)
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.host_cache_mib < 0:
            raise ValueError(f"host_cache_mib must be >= 0, got {self.host_cache_mib}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {self.max_slots}")
        check_budget_settings(self)
        if self.spec.enabled and self.async_scheduling:
            # The next tick is planned before this one's guesses are checked: it would not know where each
            # request's KV ends.
            raise ValueError("speculative decoding (num_speculative_tokens > 0) cannot be combined with "
                             "async scheduling")
        if self.lora_updates and self.async_scheduling:
            raise ValueError("LoRA adapters cannot be combined with async scheduling")

    def check_backend(self, info: BackendInfo) -> None:
        """What these settings ask of the backend an engine runs them on: ValueError if it cannot."""
        if self.n_batch > info.n_batch:
            raise ValueError(f"n_batch {self.n_batch} exceeds the backend's {info.n_batch}")
        if 0 < (most := info.max_outputs_per_seq) <= (k := self.spec.num_speculative_tokens):
            raise ValueError(f"{k} speculative tokens need {k + 1} outputs per sequence, the backend takes {most}")
        if info.n_loras and self.async_scheduling:  # the next batch would be planned before its adapter is known
            raise ValueError("LoRA adapters cannot be combined with async scheduling")
