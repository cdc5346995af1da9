"""The executor: the only engine code that touches the backend.

It runs a plan's KV operations, fills llama.cpp's batch from the plan's chunks, switches the LoRA adapter,
decodes, samples every request at its row (a constrained one's row masked by its grammar first), verifies
guessed tokens, and trims the KV cells of wrong ones. It reads the requests and never changes them: what one
decode gave comes back as a StepResult, which the engine's update phase applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from cobali.backends.base import Backend, BatchArrays, DecodeError
from cobali.engine.adapters import Adapters
from cobali.engine.batch_fill import Filled, fill_batch, read_all_prompt_logprobs
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv_tier import KvRunner
from cobali.engine.plan import KvOp, Plan
from cobali.engine.request import Drafted, Request
from cobali.engine.sampling import RowSampler, TokenLogprob, token_logprob
from cobali.engine.speculative import verify
from cobali.structured.compiler import GrammarCompiler
from cobali.structured.guide import Guide


@dataclass(frozen=True)
class StepResult:
    """What one decode gave: a token per request that sampled (None where its sampler failed), with what was
    read beside it. A steady greedy tick keeps the backend's array of tokens: the update phase converts it
    (converted here, with async scheduling, it would cost time between two decodes)."""

    requests: Sequence[Request]  # those that sampled, in output order
    tokens: Sequence[int | None] | np.ndarray
    failures: Mapping[int, Exception] = field(default_factory=dict)  # the failed samplers' errors, by request id
    logprobs: Sequence[TokenLogprob | None] | None = None  # per request, where any asked for them
    drafted: Mapping[int, Drafted] = field(default_factory=dict)  # what guessed tokens gave, by request id
    prompt_logprobs: tuple[tuple[Request, list[TokenLogprob]], ...] = ()  # entries not recorded yet
    decode_start: float = 0.0
    decode_end: float = 0.0
    sampled_at: float = 0.0  # when sampling was done: the end of a tick whose host work hides behind a decode
    error: DecodeError | None = None  # the decode failed: nothing was sampled

    @classmethod
    def nothing(cls, now: float, error: DecodeError | None = None) -> StepResult:
        """An empty plan's result, or a failed decode's."""
        return cls((), (), decode_start=now, decode_end=now, sampled_at=now, error=error)


class Prepared(NamedTuple):
    """A plan with its batch filled, ready to decode."""

    plan: Plan
    arrays: BatchArrays
    filled: Filled


class Executor:
    def __init__(self, backend: Backend, config: EngineConfig, requests: Mapping[int, Request],
                 clock: Callable[[], float]) -> None:
        """requests: the engine's live requests, by id (read only)."""
        self.backend = backend
        self.clock = clock
        self.requests = requests
        self.kv = KvRunner(backend)
        self.adapters = Adapters(backend, requests, config.lora_updates)
        # Constraints compile on the server's workers (a copy per request here): the guide masks their rows.
        self.grammars = GrammarCompiler(backend.guidance_tokenizer, config.grammar_limits)
        self.sampler = RowSampler(backend, np.flatnonzero(backend.eog_mask()),
                                  Guide(self.grammars, backend.info.n_vocab))
        self.eog_ids = frozenset(self.sampler.eog_ids.tolist())
        self.token_bytes = backend.token_bytes
        self.special_token_bytes = backend.special_token_bytes
        self.n_draft_tokens = self.n_accepted_tokens = 0  # guessed tokens fed, and those kept
        self._n_logprobs = 0  # requests taken in and not released that report sampled tokens' logprobs
        self._arrays = backend.batch_arrays()  # filled in place: decode reads these very arrays

    def add(self, request: Request) -> None:
        """A request the engine took in."""
        self._n_logprobs += request.params.logprobs is not None

    def release(self, request: Request) -> None:
        """A request ended: its sampler, its grammar's state and its hold on its adapter go."""
        self._n_logprobs -= request.params.logprobs is not None
        self.sampler.forget(request.id)
        self.adapters.release(request.lora)

    def run_kv_ops(self, ops: tuple[KvOp, ...]) -> None:
        self.kv.run(ops)

    def trim(self, slot: int, keep: int) -> None:
        """Drop the slot's KV cells from position `keep` on (rows of guesses that were wrong, or not taken)."""
        self.backend.remove_seq(slot, keep, -1)

    def execute(self, plan: Plan) -> StepResult:
        """The whole plan on the calling thread: KV operations, batch, decode, samples."""
        if plan.is_empty:
            self.kv.run(plan.kv_ops)
            return StepResult.nothing(self.clock())
        prepared = self.prepare(plan, self._arrays)
        try:
            logits, started = self.decode(prepared)
        except DecodeError as err:
            return StepResult.nothing(self.clock(), err)
        return self.sample(prepared, logits, started, self.clock())

    def prepare(self, plan: Plan, arrays: BatchArrays) -> Prepared:
        """Fill `arrays` with the plan's rows; touches no backend state (async scheduling fills the next batch
        while a decode runs)."""
        return Prepared(plan, arrays, fill_batch(arrays, plan.rows, self.requests, plan.drafts))

    def decode(self, prepared: Prepared) -> tuple[np.ndarray, float]:
        """The plan's KV operations, its adapter, then its batch through the model: the logits, and when the
        decode itself started. Raises DecodeError."""
        self.kv.run(prepared.plan.kv_ops)
        self.adapters.use(prepared.plan.lora)
        b, n = prepared.arrays, prepared.filled.n_rows
        started = self.clock()
        return self.backend.decode(b.tokens[:n], b.positions[:n], b.seq_ids[:n], b.want_logits[:n]), started

    def sample(self, prepared: Prepared, logits: np.ndarray, decode_start: float, decode_end: float,
               skip_finished: bool = False) -> StepResult:
        """Sample every request at its row, read the logprobs asked for, verify guesses; reads the logits, so
        it runs before the next decode. skip_finished (async scheduling): a request that ended while its row
        was in flight is not sampled."""
        filled = prepared.filled
        prompt_logprobs = read_all_prompt_logprobs(filled, logits) if filled.prompt_logits else ()
        requests, rows, out_rows = filled.samplers, filled.sample_rows, filled.out_rows
        if skip_finished:
            keep = [i for i, request in enumerate(requests) if not request.is_finished]
            requests, rows, out_rows = [requests[i] for i in keep], [rows[i] for i in keep], [out_rows[i] for i in keep]
        elif filled.argmax_only and not filled.verifies:  # greedy, no logprobs: one reduction, nothing per request
            return StepResult(requests, self.backend.argmax(logits), decode_start=decode_start,
                              decode_end=decode_end, sampled_at=self.clock())
        best = self.backend.argmax(logits) if filled.verifies else None
        tokens: list[int | None]
        failures: dict[int, Exception] = {}
        if best is not None and filled.argmax_only:
            tokens = best[out_rows].tolist()
        else:
            tokens, failures = self.sampler.sample(logits, requests, rows, out_rows)
        logprobs = self._logprobs(logits, requests, tokens, out_rows) if self._n_logprobs else None
        drafted = verify(filled.verifies, requests, tokens, best, logits) if best is not None else {}
        if best is not None:
            self.n_draft_tokens += sum(len(v.draft) for v in filled.verifies)
            self.n_accepted_tokens += sum(len(d.tokens) for d in drafted.values())
        return StepResult(requests, tokens, failures, logprobs, drafted, prompt_logprobs, decode_start,
                          decode_end, self.clock())

    @staticmethod
    def _logprobs(logits: np.ndarray, requests: list[Request], tokens: list[int | None], out_rows: list[int]
                  ) -> list[TokenLogprob | None]:
        """Each sampled token's logprob under the model's own distribution, where its request asked for it."""
        return [token_logprob(logits[out_row], token, k) if token is not None and (k := r.params.logprobs) is not None
                else None for r, token, out_row in zip(requests, tokens, out_rows, strict=True)]
