"""The engine: requests in, outputs out, a tick at a time.

A tick is three calls. schedule() plans one batch and commits it (each request counts its rows);
execute(plan) runs it on the backend (engine/executor.py, the only code that touches it);
update_from_output(plan, result) puts the sampled tokens in place, decodes their text, checks stops, finishes
requests and makes their outputs (engine/outputs.py). Async scheduling (engine/overlap.py) runs the same
three calls, the next plan beside the running decode.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from cobali.backends.base import Backend, BackendInfo, DecodeError
from cobali.engine.budget import AdaptiveBudget, DeadlineBudget, tick_budget
from cobali.engine.costs import CostProfile
from cobali.engine.engine_config import EngineConfig
from cobali.engine.executor import Executor, StepResult
from cobali.engine.kv import SlotPool
from cobali.engine.messages import AddRequest
from cobali.engine.outputs import EngineStats, RequestOutput, final_output_of, output_of
from cobali.engine.overlap import Pipeline
from cobali.engine.plan import ChunkKind, Plan, TickRecord
from cobali.engine.prefix_digest import GrowingKeys
from cobali.engine.request import Drafted, FinishReason, Request, RequestState
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.scheduler import Scheduler
from cobali.engine.tokenizer import Tokenizer
from cobali.engine.views import ModelInfo, SlotState, slot_states

log = logging.getLogger("cobali.engine")


class Engine:
    """Requests in (add_request, abort: thread-safe), outputs out (step, or the on_outputs sink)."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, costs: CostProfile | None = None) -> None:
        """costs: a cost profile that seeds the tick costs an ITL target learns online."""
        self._backend = backend
        self.clock = clock  # every timestamp comes from it; a simulated backend passes its virtual one
        self.config = config = config or EngineConfig()
        config.check_backend(backend.info)
        self._slots = SlotPool(backend.info, config.max_slots, config.prefix_cache, compact=config.compact_slots,
                              host_mib=config.host_cache_mib)
        self._requests: dict[int, Request] = {}
        self._executor = Executor(backend, config, self._requests, clock)
        self._adapters = self._executor.adapters  # loaded and unloaded between ticks, on the engine's thread
        self.grammars = self._executor.grammars
        self._scheduler = Scheduler(config, self._slots, tick_budget(config, costs, backend.info.prefill_tile),
                                   prefill_tile=backend.info.prefill_tile, adapters=self._adapters.enabled)
        self.tokenizer = Tokenizer(backend, self._slots.accountant.seq_limit, self._slots.accountant.context_hint())
        self.ticks: list[TickRecord] = []
        self.on_tick: Callable[[TickRecord], None] | None = None
        # Takes the outputs as they are made, on the thread that made them (with async scheduling, the host's);
        # None: step() returns them.
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None
        self.n_cut = 0  # requests that ended while a decode in flight sampled their next token (async scheduling)
        self._ids = itertools.count()
        self._made: list[RequestOutput] = []  # not handed out yet
        self._costs_confident = False
        # Other threads hand over work through these; deque append/popleft are atomic.
        self._inbox: deque[Request] = deque()
        self._aborts: deque[int] = deque()
        self._pipeline = Pipeline(self) if config.async_scheduling else None

    def model_info(self) -> ModelInfo:
        """The loaded model, as the frontend checks requests against it: on the engine's thread (it asks the
        backend)."""
        accountant = self._slots.accountant
        return ModelInfo(self._backend.info.n_vocab, accountant.seq_limit, accountant.context_hint(),
                         self._backend.info.description, self.config.max_slots, self._backend.chat_template_source(),
                         self._backend.embedding_limits)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Pooled embeddings, one row per input: from any thread, beside the ticks (the backend embeds in a context
        of its own), one call at a time."""
        return self._backend.embed(inputs)

    # What a face may ask of the engine's parts, by name: the parts themselves are private (ruff's SLF001 outside
    # cobali/engine), so that a face depends on messages and these, never on the scheduler, slots or backend.
    @property
    def backend_info(self) -> BackendInfo:
        return self._backend.info

    @property
    def n_queued(self) -> int:
        """Requests added and not holding a slot yet: waiting, or not yet taken in by a tick."""
        return len(self._requests) - len(self._scheduler.running)

    @property
    def n_live(self) -> int:
        """Requests added and not ended yet."""
        return len(self._requests)

    @property
    def n_running(self) -> int:
        """Requests holding a slot."""
        return len(self._scheduler.running)

    def kv_use(self) -> float:
        """The share of the KV's cells the running requests fill, 0..1 (cached prefixes are there to be evicted)."""
        return min(1.0, self._kv_used_tokens() / self._backend.info.n_ctx)

    def waiting_tokens(self) -> int:
        """Tokens the requests added and not ended must still prefill: their prompts' (a preempted one's outputs
        too) not computed yet; a request that generates has none."""
        return sum(r.n_context_tokens - r.computed_tokens for r in list(self._requests.values())
                   if r.state is RequestState.PENDING or r.state is RequestState.PREFILL)

    def load_adapter(self, path: str) -> int:
        """Load a LoRA adapter (between ticks, on the engine's thread): its index, for add_request's lora."""
        return self._adapters.load(path)

    def unload_adapter(self, index: int) -> None:
        self._adapters.unload(index)

    def drop_cached_prefixes(self) -> None:
        """Forget every cached prefix, so that the next requests compute theirs (a measurement's cold start)."""
        self._slots.drop_cached_prefixes()

    def held_prefixes(self) -> list[np.ndarray | GrowingKeys]:
        """The prefix cache's keys (Request.kv_key) of every KV this engine holds, the most recently used first: the
        running requests', the free slots' cached prefixes, then host memory's. What a router's digest is made of
        (engine/prefix_digest.py); on the engine's thread, between two ticks. The cached arrays are the pool's own:
        never to be changed."""
        slots = self._slots
        running: list[np.ndarray | GrowingKeys] = [GrowingKeys(r.id, r.computed_tokens, r.kv_key)
                                                   for r in reversed(self._scheduler.running)]
        cached = [slots._cached[s] for s in reversed(slots._free.in_release_order()) if s in slots._cached]
        host = [] if slots.host is None else [*reversed(slots.host._entries.values())]
        return running + cached + host

    def close(self) -> None:
        """Free the model and its context: the engine runs no more ticks."""
        self._backend.close()

    def slot_states(self) -> tuple[SlotState, ...]:
        """Every slot and the request in it; on the engine's thread, between two ticks."""
        return slot_states(self._scheduler.running, self.config.max_slots)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0, stream_interval: int | None = None,
                    lora: int = 0) -> Request:
        """Queue a request; thread-safe. Raises ValueError for a prompt that can never run. stream_interval: its
        new text goes out every this many tokens (the first text at once) and at its end; None: at its end only.
        lora: its adapter, 0: none. Returns the engine's own record of it, for the engine's tests: a frontend
        keeps only its id (or sends add() a message with an id of its own)."""
        request_id = next(self._ids)
        self.add(AddRequest(request_id, self.tokenizer.prompt_tokens(prompt), params or SamplingParams(),
                            self.clock() if arrival_time is None else arrival_time, priority, stream_interval, lora))
        return self._requests[request_id]

    def add(self, message: AddRequest) -> None:
        """Queue a request whose id its sender chose (one engine takes ids from one sender); thread-safe. Raises
        ValueError for a prompt that can never run."""
        assert message.stream_interval is None or message.stream_interval >= 1, message.stream_interval
        self._adapters.check(message.lora)
        tokens = self.tokenizer.prompt_tokens(message.prompt_tokens)  # checked again: ids and length, O(n)
        request = Request(message.request_id, tokens, message.params, priority=message.priority, lora=message.lora,
                          stream_interval=message.stream_interval, arrival_time=message.arrival_time)
        self._requests[request.id] = request
        self._inbox.append(request)

    def abort_all(self) -> None:
        """Every request added and not ended ends at the next tick; thread-safe."""
        self._aborts.extend(list(self._requests))

    def abort(self, request_id: int) -> None:
        """Ask for a request to end at the next tick, freeing its slot and KV; thread-safe."""
        self._aborts.append(request_id)

    @property
    def has_work(self) -> bool:
        in_flight = self._pipeline is not None and self._pipeline.in_flight
        return bool(self._inbox or self._aborts or self._scheduler.has_work or in_flight)

    def save_a_cached_prefix(self) -> bool:
        """Idle, copy one cached prefix to host memory (after the KV ops pending): the request that takes its slot
        later then waits for no save. False when none is left to save."""
        if not self._slots.save_a_cached_prefix():
            return False
        self._executor.run_kv_ops(self._slots.take_kv_ops())
        return True

    def step(self) -> list[RequestOutput]:
        """Run one tick: its outputs (none when on_outputs takes them). With async scheduling, those of the tick
        whose decode finished before this call's."""
        if self._pipeline is not None:
            return self._pipeline.step()
        plan = self.schedule()
        return self.deliver(self.update_from_output(plan, self.execute(plan)))

    def schedule(self) -> Plan:
        """Take what other threads handed over, and plan (and commit) the next tick."""
        now = self.clock()
        self.take_submissions(now)
        plan = self._scheduler.schedule(now)
        if self.on_outputs is not None and self._made:  # aborted requests hear of it now
            self.on_outputs(self._take_made())
        return plan

    def execute(self, plan: Plan) -> StepResult:
        """Run the plan on the backend: its KV operations, its batch, the samples."""
        return self._executor.execute(plan)

    def update_from_output(self, plan: Plan, result: StepResult, later: Plan | None = None) -> list[RequestOutput]:
        """Apply what the plan's decode gave (tokens in place, text decoded, stops checked, requests finished),
        record the tick, and return every output made since the last call. later (async scheduling): a plan made
        on this one as if it ran; if this one's decode failed, that one never runs either."""
        if result.error is not None:
            self._recover(plan, result.error, result.decode_end, later)
        elif plan.chunks:
            # With async scheduling the tokens reach their streams now, a decode after they were sampled.
            self._apply(result, self.clock() if self._pipeline is not None else result.decode_end)
        else:
            self.fail_unrunnable_head(plan.start)
        if plan.chunks:
            self._record(plan, result)
        return self._take_made()

    def deliver(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Hand outputs to on_outputs, if set (then none are left to return)."""
        if self.on_outputs is None:
            return outputs
        if outputs:
            self.on_outputs(outputs)
        return []

    def _take_made(self) -> list[RequestOutput]:
        made, self._made = self._made, []
        return made

    def _record(self, plan: Plan, result: StepResult) -> None:
        if self._pipeline is None:  # the whole tick, host work included, is what a client sees between two tokens
            record = TickRecord(plan, result.decode_start, result.decode_end, self.clock())
            seconds = record.end - record.start
        else:  # the host work hid beside the decode: the clients waited for the decode and the sampling
            record = TickRecord(plan, result.decode_start, result.decode_end, result.sampled_at)
            seconds = record.end - record.decode_start
        self.close_tick(record, None if result.error is not None else seconds)

    def close_tick(self, record: TickRecord, seconds: float | None) -> None:
        """Learn the tick's cost (seconds: what it cost the clients; None: it failed) and publish its record."""
        if seconds is not None:
            self._scheduler.budget.observe(record.plan, seconds)
            budget = self._scheduler.budget
            if isinstance(budget, AdaptiveBudget | DeadlineBudget) and budget.costs.confident != self._costs_confident:
                self._costs_confident = budget.costs.confident  # logged as it changes: learned, or costs moved
                log.info("tick costs: %s", budget.costs.describe())
        if self.config.record_ticks:
            self.ticks.append(record)
        if self.on_tick is not None:
            self.on_tick(record)

    def take_submissions(self, now: float) -> None:
        while self._inbox:
            request = self._inbox.popleft()
            self._executor.add(request)
            self._scheduler.add(request)
        while self._aborts:
            aborted = self._requests.get(self._aborts.popleft())
            if aborted is not None and not aborted.is_finished:
                self.finish(aborted, FinishReason.ABORT, now)

    def fail_unrunnable_head(self, now: float) -> None:
        """Nothing runs or was admitted: the queue head fits not even in an empty KV, and would wait forever."""
        if self._scheduler.waiting and not self._scheduler.running:
            self.finish(self._scheduler.waiting[0], FinishReason.ERROR, now, "the request does not fit in the KV cache")

    def _recover(self, plan: Plan, err: DecodeError, now: float, later: Plan | None) -> None:
        """The decode failed and llama.cpp left the KV as it was. No KV slot: the batch's newest request goes back
        to the queue, whatever the admission policy, and the rest run again. Any other failure, or a lone request
        that cannot fit, fails the batch. With a later plan made on this one, every request of either goes back."""
        in_batch = [r for r in dict.fromkeys(self._requests.get(c.request_id) for c in plan.chunks)
                    if r is not None and not r.is_finished]
        if later is None:
            for chunk in plan.chunks:
                self._requests[chunk.request_id].undo(chunk.start, chunk.yields_token, chunk.kind is ChunkKind.PREFILL)
        else:
            for chunk in plan.chunks + later.chunks:
                if (request := self._requests.get(chunk.request_id)) is not None:
                    request.drop_pending_tokens()
        if not (err.no_kv_slot and len(in_batch) > 1):
            for request in in_batch:
                self.finish(request, FinishReason.ERROR, now, f"decode failed: {err}")
        elif later is None:
            self._scheduler.preempt_newest("llama_decode found no KV slot", among={r.id for r in in_batch})
        if later is not None:
            for request_id in dict.fromkeys(c.request_id for c in plan.chunks + later.chunks):
                self._scheduler.preempt_newest(f"decode failed: {err}", among={request_id})

    def _apply(self, result: StepResult, now: float) -> None:
        """Each sampled token into its request's outputs (over its stand-in), with what was read beside it."""
        for request, entries in result.prompt_logprobs:
            request.prompt_logprobs += entries
        tokens = result.tokens.tolist() if isinstance(result.tokens, np.ndarray) else result.tokens
        logprobs, drafted = result.logprobs, result.drafted
        for i, (request, token) in enumerate(zip(result.requests, tokens, strict=True)):
            if token is None:
                self.finish(request, FinishReason.ERROR, now, result.failures[request.id])
                continue
            count = request.add_token(token)
            if logprobs is not None and (logprob := logprobs[i]) is not None:
                request.logprobs.append(logprob)
            guessed = drafted.get(request.id) if drafted else None
            if guessed is not None:  # the guessed rows count again one by one as their tokens are kept
                request.computed_tokens = guessed.start
            self._accept(request, token, count, now)
            if guessed is not None:
                self._accept_guesses(request, guessed, now)

    def _accept(self, request: Request, token: int, count: int, now: float) -> None:
        """Stream, stop-check and finish a token just placed; count: the request's outputs up to and including it
        (with async scheduling a stand-in may stand in line behind it)."""
        request.token_times.append(now)
        params = request.params
        is_eog = (token in self._executor.eog_ids and not params.ignore_eos) or token in params.stop_token_ids
        stream = request.stream
        # Text is decoded only when someone reads it now: a due stream, or stop strings; else later or at the end.
        due = request.stream_interval is not None and stream.is_due(count)
        hit_stop = not is_eog and (due or stream.checks_each_token) and self._decode_to(request, count)
        reason = (FinishReason.STOP if is_eog or hit_stop
                  else FinishReason.LENGTH if request.is_at_length(count, self._slots.accountant.seq_limit) else None)
        if reason is not None:
            self.finish(request, reason, now, stopped=hit_stop)
        elif due:  # with no text yet (an end token under ignore_eos, a held-back stop prefix): an empty delta, as vLLM
            self._made.append(output_of(request, stream.take(count), count))

    def _accept_guesses(self, request: Request, drafted: Drafted, now: float) -> None:
        """The tokens a tick's guesses gave, each counted into the KV as it is kept, until the request ends; the
        cells past the last token kept (wrong guesses, or tokens after the end) leave the KV."""
        for token, logprob in zip(drafted.tokens, drafted.logprobs, strict=True):
            if request.is_finished:
                break
            request.computed_tokens += 1
            if logprob is not None:
                request.logprobs.append(logprob)
            self._accept(request, token, request.add_token(token), now)
        if request.computed_tokens < drafted.end:
            self._executor.trim(drafted.slot, request.computed_tokens)

    def _decode_to(self, request: Request, end: int) -> bool:
        """Push output tokens up to `end` into the request's text; True when a stop string was hit."""
        stream = request.stream
        tokens = request.output_tokens[stream.decoded : end]
        if not tokens:
            return False
        preserved, plain = request.params.preserved_tokens, self._executor.token_bytes  # preserved: their text kept
        text = (b"".join(map(plain, tokens)) if not preserved else
                b"".join(self._executor.special_token_bytes(t) if t in preserved else plain(t) for t in tokens))
        return stream.push(text, decoded=end)

    def finish(self, request: Request, reason: FinishReason, now: float, error: str | Exception | None = None,
               stopped: bool = False) -> None:
        """End a request, free its slot and KV now, and make its final output. stopped: a stop string cut its text."""
        self.n_cut += request.drop_pending_tokens()
        request.finish(reason, now, error)
        del self._requests[request.id]
        self._scheduler.remove(request, keep_kv=reason in (FinishReason.STOP, FinishReason.LENGTH))
        self._executor.release(request)
        if not stopped:  # the text not decoded yet (an end-of-generation token is not text)
            self._decode_to(request, len(request.output_tokens) - (reason is FinishReason.STOP))
        text = request.stream.close(stopped)
        if reason is FinishReason.STOP:  # vLLM's stop_reason: the stop string or stop token id; None: an end token
            last, ids = request.output_tokens[-1], request.params.stop_token_ids
            request.stop_reason = request.stream.stop_hit if stopped else (last if last in ids else None)
        self._made.append(final_output_of(request, text))

    def _kv_used_tokens(self) -> int:
        return sum(r.computed_tokens for r in list(self._scheduler.running))

    def stats(self) -> EngineStats:
        """The gauges and totals now; from any thread."""
        scheduler, slots, executor, budget = self._scheduler, self._slots, self._executor, self._scheduler.budget
        learned = budget.costs if isinstance(budget, AdaptiveBudget | DeadlineBudget) else None
        tail = budget.tail if isinstance(budget, AdaptiveBudget) else None
        return EngineStats(
            n_running=len(scheduler.running), n_waiting=len(scheduler.waiting),
            kv_used_tokens=self._kv_used_tokens(), n_ctx=self._backend.info.n_ctx,
            preemptions=scheduler.preemptions, prefix_queried_tokens=slots.queried_tokens,
            prefix_hit_tokens=slots.hit_tokens,
            prefix_host_hit_tokens=slots.host.hit_tokens if slots.host is not None else 0,
            draft_tokens=executor.n_draft_tokens, accepted_draft_tokens=executor.n_accepted_tokens,
            host_cache_bytes=executor.kv.saved_bytes,
            tick_cost_error=learned.error if learned is not None else None,
            tick_cost_confident=learned.confident if learned is not None else None,
            whole_prompt_stall_share=tail.share if tail is not None else None)
