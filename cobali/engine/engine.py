"""The tick loop: plan one batch, run one decode, sample every request at its row."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from cobali.backends.base import Backend, DecodeError, SamplingParams
from cobali.engine.adapters import Adapters
from cobali.engine.batch_fill import Filled, fill_batch, record_all_prompt_logprobs
from cobali.engine.budget import tick_budget
from cobali.engine.costfit import CostCoefficients
from cobali.engine.detok import TextStream
from cobali.engine.driving import Driving
from cobali.engine.engine_config import EngineConfig
from cobali.engine.kv import SlotPool
from cobali.engine.kv_tier import KvRunner
from cobali.engine.overlap import Pipeline
from cobali.engine.plan import Plan, TickRecord
from cobali.engine.policies import admission_for_mode, batch_policy, kv_policy
from cobali.engine.queue import WaitQueue
from cobali.engine.request import FinishReason, Request, Sampled
from cobali.engine.sampling import RowSampler, token_logprob
from cobali.engine.scheduler import Scheduler
from cobali.engine.speculative import Drafted, NgramDrafter, verify
from cobali.structured.compiler import GrammarCompiler
from cobali.structured.guide import Guide

# Called with a request's new text (as it comes, or every stream_interval tokens) and at finish: (request, text
# delta, the outputs it covers: with async scheduling the request already holds a stand-in for the next one).
# Runs on the thread that streams the tokens (with async scheduling, the host's).
TokenCallback = Callable[[Request, str, int], None]


class Engine(Driving):
    """The tick loop and its requests' lifecycle; Driving adds the blocking run, generate and stream."""

    def __init__(self, backend: Backend, config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter, costs: CostCoefficients | None = None) -> None:
        """costs: a cost profile that seeds the tick costs an ITL target learns online."""
        self.backend = backend
        self.clock = clock  # every timestamp comes from it; a simulated backend passes its virtual one
        self.config = config = config or EngineConfig()
        config.check_backend(backend.info)
        self.slots = SlotPool(backend.info, config.max_slots, config.prefix_cache, compact=config.compact_slots,
                              host_mib=config.host_cache_mib)
        self.kv_runner = KvRunner(backend)
        self.requests: dict[int, Request] = {}
        self.adapters = Adapters(backend, self.requests, config.lora_updates)
        self.scheduler = Scheduler(
            self.slots, admission_for_mode(config.mode, config.prefill_chunk_tokens), config.n_batch,
            batch=batch_policy(config.policy), kv=kv_policy(config.kv_admission), queue=WaitQueue(config.queue),
            budget=tick_budget(config, costs, backend.info.prefill_tile), prefill_tile=backend.info.prefill_tile,
            drafter=NgramDrafter(config.spec) if config.spec.enabled else None, adapters=self.adapters.enabled,
        )
        # Constraints compile on the server's workers (a copy per request here): the guide masks their rows.
        self.grammars = GrammarCompiler(backend.guidance_tokenizer, config.grammar_limits)
        self.sampler = RowSampler(backend, np.flatnonzero(backend.eog_mask()),
                                  Guide(self.grammars, backend.info.n_vocab))
        self._eog_ids = frozenset(self.sampler.eog_ids.tolist())
        self.ticks: list[TickRecord] = []
        self.on_tick: Callable[[TickRecord], None] | None = None
        # After a decode's tokens were streamed, on the thread that streamed them (async scheduling: the host's).
        self.on_accepted: Callable[[], None] | None = None
        self._ids = itertools.count()
        self._texts: dict[int, TextStream] = {}
        self.n_cut = 0  # requests that ended while a decode in flight sampled their next token (async scheduling)
        self.n_draft_tokens = self.n_accepted_tokens = 0  # guessed tokens fed, and those kept (engine/spec.py)
        self._n_logprobs = 0  # requests taken in and not finished that report sampled tokens' logprobs
        self._callbacks: dict[int, TokenCallback] = {}
        # Other threads hand over work through these; deque append/popleft are atomic.
        self._inbox: deque[Request] = deque()
        self._aborts: deque[int] = deque()
        self._batch = backend.batch_arrays()  # filled in place: decode reads these very arrays
        self._pipeline = Pipeline(self) if config.async_scheduling else None

    def tokenize_prompt(self, prompt: str | list[int], keep: int | None = None) -> list[int]:
        """keep: only the last `keep` tokens (vLLM's truncate_prompt_tokens)."""
        limit = self.slots.accountant.seq_limit
        if isinstance(prompt, str):  # one that cannot fit is not tokenized: the cost grows with the text
            most = ((keep + 1) if keep else limit) * self.backend.info.max_token_bytes
            if keep is None and most and len(prompt) > most:
                raise ValueError(f"prompt has over {limit} tokens ({len(prompt)} characters); the context holds "
                                 f"{limit} per request ({self.slots.accountant.context_hint()})")
            tokens = self.backend.tokenize(prompt[-most:] if most else prompt)
        else:
            tokens = list(prompt)
        tokens = tokens if keep is None else tokens[-keep:]
        if not tokens:
            raise ValueError("prompt is empty")
        if len(tokens) >= limit:
            raise ValueError(f"prompt has {len(tokens)} tokens; the context holds {limit} per request "
                             f"({self.slots.accountant.context_hint()})")
        n_vocab = self.backend.info.n_vocab
        if any(not 0 <= t < n_vocab for t in tokens):
            raise ValueError(f"prompt token ids must be in [0, {n_vocab})")
        return tokens

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    on_token: TokenCallback | None = None, arrival_time: float | None = None, priority: int = 0,
                    stream_interval: int = 1, lora: int = 0) -> Request:
        """Queue a request; thread-safe. Raises ValueError for a prompt that can never run. on_token gets the new
        text every stream_interval tokens (the first text at once), and at the end. lora: its adapter, 0: none."""
        params = params or SamplingParams()
        self.adapters.check(lora)
        request = Request(next(self._ids), self.tokenize_prompt(prompt), params, priority=priority, lora=lora,
                          arrival_time=self.clock() if arrival_time is None else arrival_time)
        self.requests[request.id] = request
        self._texts[request.id] = TextStream(params.stop, stream_interval, params.min_tokens, params.include_stop_str)
        if on_token is not None:
            self._callbacks[request.id] = on_token
        self._inbox.append(request)
        return request

    def abort(self, request_id: int) -> None:
        """Ask for a request to end at the next tick, freeing its slot and KV; thread-safe."""
        self._aborts.append(request_id)

    @property
    def has_work(self) -> bool:
        in_flight = self._pipeline is not None and self._pipeline.in_flight
        return bool(self._inbox or self._aborts or self.scheduler.has_work or in_flight)

    def save_a_cached_prefix(self) -> bool:
        """Idle, copy one cached prefix to host memory (after the KV ops pending): the request that takes its slot
        later then waits for no save (fresh pages, ~2 ms a MiB on this VM). False when none is left to save."""
        if not self.slots.save_a_cached_prefix():
            return False
        self.kv_runner.run(self.slots.take_kv_ops())
        return True

    def step(self) -> TickRecord | None:
        """Run one tick; None when nothing could run. With async scheduling the record is of the tick whose
        decode finished in this call, while the next one's already runs."""
        if self._pipeline is not None:
            return self._pipeline.step()
        start = self.clock()
        self.take_submissions(start)
        plan = self.scheduler.schedule(start)
        self.kv_runner.run(plan.kv_ops)
        if plan.is_empty:
            self.fail_unrunnable_head(start)
            return None
        filled = fill_batch(self._batch, plan.rows, self.requests, start, plan.drafts)
        self.adapters.use(plan.lora)
        n = filled.n_rows
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
            self.advance(plan, filled)
            sampled = self.sample(filled, logits)
            self.place_tokens(sampled)
            self.accept(sampled, decode_end)
            decoded = True
        record = TickRecord(plan, start, decode_start, decode_end, self.clock(),
                            n_running=n_running, n_waiting=n_waiting)
        # The whole tick, host work included, is what a client sees between two tokens.
        self.close_tick(record, record.end - record.start if decoded else None)
        return record

    def close_tick(self, record: TickRecord, seconds: float | None) -> None:
        """Learn the tick's cost (seconds: what it cost the clients; None: it failed) and publish its record."""
        if seconds is not None:
            self.scheduler.budget.observe(record.plan, seconds)
        if self.config.record_ticks:
            self.ticks.append(record)
        if self.on_tick is not None:
            self.on_tick(record)

    def take_submissions(self, now: float) -> None:
        while self._inbox:
            request = self._inbox.popleft()
            self._n_logprobs += request.params.logprobs is not None  # counted here: one thread writes it
            self.scheduler.add(request)
        while self._aborts:
            request = self.requests.get(self._aborts.popleft())
            if request is not None and not request.is_finished:
                self.finish(request, FinishReason.ABORT, now)

    def fail_unrunnable_head(self, now: float) -> None:
        """Nothing runs or was admitted: the queue head fits not even in an empty KV, and would wait forever."""
        if self.scheduler.waiting and not self.scheduler.running:
            self.finish(self.scheduler.waiting[0], FinishReason.ERROR, now, "the request does not fit in the KV cache")

    def _recover(self, plan: Plan, err: DecodeError, now: float) -> None:
        """No KV slot: the batch's newest request is preempted, whatever the admission policy (llama.cpp left the
        KV as it was: the rest run again next tick). Any other failure, or a lone request that cannot fit, fails."""
        in_batch = {c.request_id for c in plan.chunks}
        if err.no_kv_slot and len(in_batch) > 1:
            self.scheduler.preempt_newest("llama_decode found no KV slot", among=in_batch)
            return
        for request_id in in_batch:
            self.finish(self.requests[request_id], FinishReason.ERROR, now, f"decode failed: {err}")

    def advance(self, plan: Plan, filled: Filled, pending: bool = False) -> None:
        """Count the plan's rows into its requests' KV; pending (async scheduling, at launch): also the tokens
        its decode will sample, as stand-ins the next plan can already feed."""
        for chunk, request in zip(plan.rows, filled.requests, strict=True):
            request.advance(chunk.n_tokens, pending and chunk.yields_token)

    def sample(self, filled: Filled, logits: np.ndarray, cut_since: int | None = None) -> Sampled:
        """Sample every request at its row, and record the logprobs asked for; reads the logits, so it runs
        before the next decode. cut_since (async scheduling): self.n_cut when the batch was filled; a request
        that ended since, while its row was in flight, is skipped."""
        record_all_prompt_logprobs(filled, logits)
        sampled, rows, out_rows = filled.samplers, filled.sample_rows, filled.out_rows
        if cut_since not in (None, self.n_cut):
            keep = [i for i, request in enumerate(sampled) if not request.is_finished]
            sampled, rows, out_rows = [sampled[i] for i in keep], [rows[i] for i in keep], [out_rows[i] for i in keep]
        elif filled.argmax_only and not filled.verifies:  # greedy, no logprobs: one reduction, nothing per request
            return Sampled(sampled, self.backend.argmax(logits), {})
        best = self.backend.argmax(logits) if filled.verifies else None
        if best is not None and filled.argmax_only:
            tokens, failures = best[out_rows].tolist(), {}
        else:
            tokens, failures = self.sampler.sample(logits, sampled, rows, out_rows)
        if self._n_logprobs:
            for request, token, out_row in zip(sampled, tokens, out_rows, strict=True):
                if token is not None and request.params.logprobs is not None:
                    request.logprobs.append(token_logprob(logits[out_row], token, request.params.logprobs))
        if best is None:
            return Sampled(sampled, tokens, failures)
        drafted = verify(filled.verifies, sampled, tokens, best, logits)
        self.n_draft_tokens += sum(len(v.draft) for v in filled.verifies)
        self.n_accepted_tokens += sum(len(d.tokens) for d in drafted.values())
        return Sampled(sampled, tokens, failures, drafted=drafted)

    def place_tokens(self, sampled: Sampled) -> None:
        """Put the sampled tokens in their requests' outputs (over the stand-ins `advance` left, if any)."""
        if isinstance(sampled.tokens, np.ndarray):
            sampled.tokens = sampled.tokens.tolist()
        sampled.counts[:] = [r.place_token(t) for r, t in zip(sampled.requests, sampled.tokens, strict=True)]

    def accept(self, sampled: Sampled, now: float) -> None:
        """Stream, stop-check and finish what was sampled (place_tokens first)."""
        for request, token, count in zip(sampled.requests, sampled.tokens, sampled.counts, strict=True):
            if token is None:
                self.finish(request, FinishReason.ERROR, now, sampled.failures[request.id])
            else:
                self._accept(request, token, count, now)
                if sampled.drafted and request.id in sampled.drafted:
                    self._accept_guesses(request, sampled.drafted[request.id], now)
        if self.on_accepted is not None:
            self.on_accepted()

    def _accept(self, request: Request, token: int, count: int, now: float) -> None:
        """count: the request's outputs up to and including this token (more may stand in line behind it)."""
        request.token_times.append(now)
        is_eog = (token in self._eog_ids and not request.params.ignore_eos) or token in request.params.stop_token_ids
        stream = self._texts[request.id]
        callback = self._callbacks.get(request.id)
        # Text is decoded only when someone reads it now: a due stream, or stop strings; else later or at the end.
        due = callback is not None and stream.is_due(count)
        hit_stop = not is_eog and (due or stream.checks_each_token) and self._decode_to(request, stream, count)
        reason = (FinishReason.STOP if is_eog or hit_stop
                  else FinishReason.LENGTH if request.is_at_length(count, self.slots.accountant.seq_limit) else None)
        if reason is not None:
            self.finish(request, reason, now, stopped=hit_stop)
        elif due:  # with no text yet (an end token under ignore_eos, a held-back stop prefix): an empty delta, as vLLM
            callback(request, stream.take(count), count)

    def _accept_guesses(self, request: Request, drafted: Drafted, now: float) -> None:
        """The tokens a tick's guesses gave, each counted into the KV as it is kept, until the request ends; the
        cells past the last token kept (wrong guesses, or tokens after the end) leave the KV."""
        for token, logprob in zip(drafted.tokens, drafted.logprobs, strict=True):
            if request.is_finished:
                break
            request.computed_tokens += 1
            if logprob is not None:
                request.logprobs.append(logprob)
            self._accept(request, token, request.place_token(token), now)
        if request.computed_tokens < drafted.end:
            self.backend.remove_seq(drafted.slot, request.computed_tokens, -1)

    def _decode_to(self, request: Request, stream: TextStream, end: int) -> bool:
        """Push output tokens up to `end` into the request's text; True when a stop string was hit."""
        tokens = request.output_tokens[stream.decoded : end]
        return bool(tokens) and stream.push(b"".join(map(self.backend.token_bytes, tokens)), decoded=end)

    def finish(self, request: Request, reason: FinishReason, now: float, error: str | Exception | None = None,
               stopped: bool = False) -> None:
        """End a request and free its slot and KV now. stopped: a stop string cut its text."""
        self.n_cut += request.drop_pending_tokens()
        request.finish(reason, now, error)
        del self.requests[request.id]
        self.adapters.release(request.lora)
        self._n_logprobs -= request.params.logprobs is not None
        self.scheduler.remove(request, keep_kv=reason in (FinishReason.STOP, FinishReason.LENGTH))
        self.sampler.forget(request.id)
        stream = self._texts.pop(request.id)
        if not stopped:  # the text not decoded yet (an end-of-generation token is not text)
            self._decode_to(request, stream, len(request.output_tokens) - (reason is FinishReason.STOP))
        delta = stream.close(stopped)
        request.text = stream.text
        if reason is FinishReason.STOP:  # vLLM's stop_reason: the stop string or stop token id; None: an end token
            last, ids = request.output_tokens[-1], request.params.stop_token_ids
            request.stop_reason = stream.stop_hit if stopped else (last if last in ids else None)
        callback = self._callbacks.pop(request.id, None)
        if callback is not None:
            callback(request, delta, len(request.output_tokens))
