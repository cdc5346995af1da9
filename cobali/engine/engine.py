"""The tick loop: plan one batch, run one decode, sample every request at its row."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from cobali.backends.base import Backend, DecodeError, SamplingParams
from cobali.engine.batch_fill import fill_batch
from cobali.engine.budget import tick_budget
from cobali.engine.costfit import CostCoefficients, TickTerms
from cobali.engine.detok import TextStream
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.plan import ClearSlot, CopyPrefix, KvOp, Plan, TickRecord, TrimSlot
from cobali.engine.policies import admission_for_mode, batch_policy, kv_policy
from cobali.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logits
from cobali.engine.queue import WaitQueue
from cobali.engine.request import FinishReason, Request, RequestState
from cobali.engine.sampling import RowSampler, token_logprob
from cobali.engine.scheduler import Scheduler

# Called after every sampled token and at finish: (request, text delta). Runs on the engine thread.
TokenCallback = Callable[[Request, str], None]


class Engine:
    def __init__(self, backend: Backend, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, costs: CostCoefficients | None = None) -> None:
        """costs: a cost profile that seeds the tick costs an ITL target learns online."""
        self.backend = backend
        # Every timestamp comes from this clock; a simulated backend passes its virtual one.
        self.clock = clock
        self.config = config = config or EngineConfig()
        if config.n_batch > backend.info.n_batch:
            raise ValueError(f"n_batch {config.n_batch} exceeds the backend's {backend.info.n_batch}")
        self.slots = SlotPool(backend.info, config.max_slots, prefix_cache=config.prefix_cache)
        self.scheduler = Scheduler(
            self.slots, admission_for_mode(config.mode, config.prefill_chunk_tokens), config.n_batch,
            batch=batch_policy(config.policy), kv=kv_policy(config.kv_admission), queue=WaitQueue(config.queue),
            budget=tick_budget(config, costs, backend.info.prefill_tile),
            prefill_tile=backend.info.prefill_tile,
        )
        self.sampler = RowSampler(backend)
        self._eog_ids = frozenset(np.flatnonzero(backend.eog_mask()).tolist())
        self.requests: dict[int, Request] = {}
        self.ticks: list[TickRecord] = []
        self.on_tick: Callable[[TickRecord], None] | None = None
        self._ids = itertools.count()
        self._texts: dict[int, TextStream] = {}
        self._callbacks: dict[int, TokenCallback] = {}
        # Other threads hand over work through these; deque append/popleft are atomic.
        self._inbox: deque[Request] = deque()
        self._aborts: deque[int] = deque()
        self._batch = backend.batch_arrays()  # filled in place: decode reads these very arrays

    # ---- submitting -------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        tokens = self.backend.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise ValueError("prompt is empty")
        limit = self.slots.accountant.seq_limit
        if len(tokens) >= limit:
            raise ValueError(f"prompt has {len(tokens)} tokens; the context holds {limit} per request")
        n_vocab = self.backend.info.n_vocab
        if any(not 0 <= t < n_vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {n_vocab})")
        return tokens

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        on_token: TokenCallback | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Queue a request; thread-safe. Raises ValueError for a prompt that can never run."""
        params = params or SamplingParams()
        request = Request(next(self._ids), self.tokenize_prompt(prompt), params, priority=priority,
                          arrival_time=self.clock() if arrival_time is None else arrival_time)
        self.requests[request.id] = request
        # Text as tokens arrive only where someone reads it on the way (a stream, stop strings); else at the end.
        self._texts[request.id] = TextStream(params.stop, live=on_token is not None or bool(params.stop))
        if on_token is not None:
            self._callbacks[request.id] = on_token
        self._inbox.append(request)
        return request

    def abort(self, request_id: int) -> None:
        """Ask for a request to end at the next tick, freeing its slot and KV; thread-safe."""
        self._aborts.append(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work)

    # ---- the tick ---------------------------------------------------------------------------------

    def step(self) -> TickRecord | None:
        start = self.clock()
        self._take_submissions(start)
        plan = self.scheduler.schedule(start)
        self._run_kv_ops(plan.kv_ops)
        if plan.is_empty:
            self._fail_unrunnable_head(start)
            return None
        n = fill_batch(self._batch, plan.rows, self.requests, start)
        n_running, n_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        decode_start = self.clock()
        try:
            b = self._batch
            logits = self.backend.decode(b.tokens[:n], b.positions[:n], b.seq_ids[:n], b.want_logits[:n])
        except DecodeError as err:
            decode_end = self.clock()
            self._recover(plan, err, decode_end)
            decoded = False
        else:
            decode_end = self.clock()
            self._sample_plan(plan, logits, decode_end)
            decoded = True
        record = TickRecord(plan, start, decode_start, decode_end, self.clock(),
                            n_running=n_running, n_waiting=n_waiting)
        if decoded:  # the whole tick, host work included, is what a client sees between two tokens
            self.scheduler.budget.observe(TickTerms.of_plan(plan), record.end - record.start)
        if self.config.record_ticks:
            self.ticks.append(record)
        if self.on_tick is not None:
            self.on_tick(record)
        return record

    def _take_submissions(self, now: float) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        while self._aborts:
            request = self.requests.get(self._aborts.popleft())
            if request is not None and not request.is_finished:
                self._finish(request, FinishReason.ABORT, now)

    def _fail_unrunnable_head(self, now: float) -> None:
        """Nothing runs and nothing was admitted: the queue head cannot fit even in an empty KV, and
        waiting would hang forever."""
        if self.scheduler.waiting and not self.scheduler.running:
            head = self.scheduler.waiting[0]
            self._finish(head, FinishReason.ERROR, now, "the request does not fit in the KV cache")

    def _run_kv_ops(self, ops: tuple[KvOp, ...]) -> None:
        for op in ops:
            match op:
                case ClearSlot(slot):
                    self.backend.remove_seq(slot)
                case TrimSlot(slot, keep):
                    self.backend.remove_seq(slot, keep, -1)
                case CopyPrefix(source, slot, n_tokens):
                    # The whole sequence, then its tail dropped: llama.cpp copies between per-sequence
                    # streams only whole.
                    self.backend.copy_seq(source, slot, 0, -1)
                    self.backend.remove_seq(slot, n_tokens, -1)

    def _recover(self, plan: Plan, err: DecodeError, now: float) -> None:
        """llama.cpp finding no KV slot preempts the batch's newest request, whatever the admission policy
        (llama.cpp left the KV as it was, so the rest simply run again next tick); any other failure, or a
        lone request that cannot fit, fails the batch."""
        in_batch = {c.request_id for c in plan.chunks}
        if err.no_kv_slot and len(in_batch) > 1:
            self.scheduler.preempt_newest("llama_decode found no KV slot", among=in_batch)
            return
        for request_id in in_batch:
            self._finish(self.requests[request_id], FinishReason.ERROR, now, f"decode failed: {err}")

    def _sample_plan(self, plan: Plan, logits: np.ndarray, now: float) -> None:
        requests, sampled, rows, out_rows, row, out = self.requests, [], [], [], 0, 0  # out: logits rows used
        for chunk in plan.rows:
            request = requests[chunk.request_id]
            request.computed_tokens += chunk.n_tokens
            row += chunk.n_tokens
            if wants_prompt_logits(request, chunk.start):
                record_prompt_logprobs(request, chunk.start, logits[out:out + chunk.n_tokens])
                out += chunk.n_tokens
            elif chunk.yields_token:
                out += 1
            if chunk.yields_token:
                sampled.append(request)
                rows.append(row - 1)
                out_rows.append(out - 1)
        tokens, failures = self.sampler.sample(logits, sampled, rows, out_rows)
        for request, token, out_row in zip(sampled, tokens, out_rows, strict=True):
            if token is None:
                self._finish(request, FinishReason.ERROR, now, f"sampling failed: {failures[request.id]}")
                continue
            if request.params.logprobs is not None:
                request.logprobs.append(token_logprob(logits[out_row], token, request.params.logprobs))
            self._accept(request, token, now)

    def _accept(self, request: Request, token: int, now: float) -> None:
        if request.state is RequestState.PREFILL:
            request.transition(RequestState.DECODE)
        request.output_tokens.append(token)
        request.token_times.append(now)
        is_eog = token in self._eog_ids and not request.params.ignore_eos
        stream = self._texts[request.id]
        delta, hit_stop = "", False
        if stream.live and not is_eog:
            delta, hit_stop = stream.push(self.backend.token_bytes(token))
        reason = self._finish_reason(request, is_eog or hit_stop)
        if reason is None:
            if request.id in self._callbacks:
                self._emit(request, delta)
        else:
            self._finish(request, reason, now, delta=delta, flush=not hit_stop)

    def _finish_reason(self, request: Request, stopped: bool) -> FinishReason | None:
        if stopped:
            return FinishReason.STOP
        if len(request.output_tokens) >= request.params.max_tokens:
            return FinishReason.LENGTH
        if request.n_context_tokens >= self.slots.accountant.seq_limit:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now: float, error: str | None = None,
                delta: str = "", flush: bool = True) -> None:
        """End a request and free its slot and KV now. Held-back text is final unless a stop string cut it."""
        request.finish(reason, now, error)
        del self.requests[request.id]
        self.scheduler.remove(request, keep_kv=reason in (FinishReason.STOP, FinishReason.LENGTH))
        self.sampler.forget(request.id)
        stream = self._texts.pop(request.id)
        if not stream.live:  # nobody needed text on the way: render it once (an end-of-generation token is not text)
            shown = request.output_tokens[:-1] if reason is FinishReason.STOP else request.output_tokens
            stream.push(b"".join(map(self.backend.token_bytes, shown)))
        if flush:
            delta += stream.flush()
        request.text = stream.text
        self._emit(request, delta)
        self._callbacks.pop(request.id, None)

    def _emit(self, request: Request, delta: str) -> None:
        callback = self._callbacks.get(request.id)
        if callback is not None:
            callback(request, delta)

    # ---- driving ----------------------------------------------------------------------------------

    def run_until_done(self, on_finish: Callable[[Request], None] | None = None) -> None:
        pending = list(self._inbox) + self.scheduler.running + list(self.scheduler.waiting)
        while self.has_work:
            self.step()
            if on_finish is not None:
                done = [r for r in pending if r.is_finished]
                pending = [r for r in pending if not r.is_finished]
                for request in done:
                    on_finish(request)

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None) -> list[Request]:
        """Run prompts to completion. A prompt that cannot run comes back FAILED with its error."""
        requests = [self.submit(p, params) for p in prompts]
        self.run_until_done()
        return requests

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               arrival_time: float | None = None) -> Request:
        """Like add_request, but a prompt that cannot run becomes a FAILED request instead of raising."""
        try:
            return self.add_request(prompt, params, arrival_time=arrival_time)
        except ValueError as err:
            request = Request(next(self._ids), [], params or SamplingParams())
            request.finish(FinishReason.ERROR, self.clock(), str(err))
            return request

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt on the caller's thread, yielding text as it is produced."""
        deltas: deque[str] = deque()
        request = self.add_request(prompt, params, on_token=lambda _r, d: deltas.append(d))
        while not request.is_finished:
            self.step()
            while deltas:
                if delta := deltas.popleft():
                    yield delta
        yield from (d for d in deltas if d)

