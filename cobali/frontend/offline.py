"""The engine driven on the caller's thread: generate a list of prompts or chats, embed texts, stream one
prompt's text, or run a long stream of requests through a bounded feed window. The library under `cobali run`,
batch jobs, the simulator and the benchmarks, and a Python user's first two lines:

    llm = LLM("model.gguf", max_slots=8)        # or LLM(): the embedded model
    print(llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))[0].text)
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from cobali.engine.engine import Engine
from cobali.engine.outputs import RequestOutput, refused
from cobali.engine.sampling_params import SamplingParams
from cobali.engine.setup import EngineSetup
from cobali.frontend.chat_template import ChatPrompter

Conversation = list[dict[str, Any]]  # chat messages, OpenAI's shape

# A long stream's feed window: enough waiting requests to keep admission busy (a tick admits at most
# max_slots), plus room for the wait queue's head-of-line bypass (WaitQueue.max_bypass). The engine's queue
# sorts on every push and scans on every remove: fine for a few hundred requests, quadratic for 10^5.
FEED_PER_SLOT = 2
FEED_EXTRA = 8


@dataclass(frozen=True)
class Pending:
    key: Hashable  # the caller's name for the request, handed back with its final output
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None = None  # None: when the engine takes it


class LLM:
    """Requests in, final outputs out. A request's final output here is its whole output (text, tokens,
    logprobs, stats): its text is handed out only at its end. A prompt that can never run comes back as a
    failed output (request_id < 0: never queued)."""

    def __init__(self, model: Engine | str | None = None, window: int | None = None, **options: Any) -> None:
        """model: an engine to drive, or a GGUF file to load (None: the embedded model) into an engine built from
        `options` (EngineSetup.from_options: max_slots=8, n_ctx=4096, ...), which close() frees. window: requests
        pushed and handed to the engine but not running yet, at most (the rest wait in a FIFO backlog); None: no
        bound."""
        if isinstance(model, Engine):
            if options:
                raise ValueError(f"options ({', '.join(options)}) configure an engine LLM builds, not one given")
            engine, self._owns_engine = model, False
        else:
            engine, self._owns_engine = EngineSetup.from_options(model, **options).build_engine(), True
        assert engine.on_outputs is None, "the outputs are this driver's to read"
        self.engine = engine
        self._prompter: ChatPrompter | None = None  # the model's chat template, read at the first chat
        self.window = window
        self._backlog: deque[Pending] = deque()
        self._keys: dict[int, Hashable] = {}  # request id -> the key it was pushed with
        self._refused: list[RequestOutput] = []  # reported at the next step
        self._n_refused = 0

    @staticmethod
    def feed_window(engine: Engine) -> int:
        """A window that keeps admission busy (for run() over a long stream)."""
        return FEED_PER_SLOT * engine.config.max_slots + FEED_EXTRA

    def push(self, item: Pending) -> None:
        """Queue a request behind the window; its final output comes back from step() or run() with its key."""
        self._backlog.append(item)

    @property
    def has_work(self) -> bool:
        return bool(self._backlog or self._refused) or self.engine.has_work

    def step(self) -> list[tuple[Hashable, RequestOutput]]:
        """Feed the engine from the backlog and run one tick: the final outputs of the requests that ended in it,
        each with its key (a request added to the engine directly is keyed by its id)."""
        self._feed()
        return [(self._keys.pop(o.request_id, o.request_id), o) for o in self._tick() if o.finished]

    def run(self) -> Iterator[tuple[Hashable, RequestOutput]]:
        """step() until no work is left."""
        while self.has_work:
            yield from self.step()

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None,
                 arrival_time: float | None = None) -> list[RequestOutput]:
        """Run prompts to completion (all queued at once, past any window): their final outputs, in order."""
        keys = [self.submit(prompt, params, arrival_time=arrival_time) for prompt in prompts]
        finished = dict(self.run())
        return [finished[key] for key in keys]

    def chat(self, messages: Conversation | list[Conversation], params: SamplingParams | None = None, *,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation, or a list of them, through the model's chat template (as `cobali serve` renders
        it), run to completion: a final output per conversation."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = cast(list[Conversation], [messages] if one else messages)
        return self.generate([self._chat_prompt(c, tools, chat_template_kwargs) for c in conversations], params)

    def embed(self, inputs: Sequence[str | list[int]]) -> np.ndarray:
        """Pooled embeddings, a row per input (text or token ids), as /v1/embeddings computes them."""
        tokenizer, limits = self.engine.tokenizer, self.engine.model_info().embeddings
        batch = [tokenizer.encode(item) if isinstance(item, str) else list(item) for item in inputs]
        for tokens in batch:
            tokenizer.check_ids(tokens, "input token ids")
            if not 0 < len(tokens) <= limits.max_tokens:
                raise ValueError(f"an input has {len(tokens)} tokens; embeddings take 1 to {limits.max_tokens}")
        return self.engine.embed(batch)

    def close(self) -> None:
        """Free the model, where this LLM loaded it."""
        if self._owns_engine:
            self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     variables: Mapping[str, Any] | None) -> str:
        if self._prompter is None:
            tokenizer = self.engine.tokenizer
            self._prompter = ChatPrompter(self.engine.model_info().chat_template, tokenizer.apply_chat_template,
                                          tokenizer.max_prompt_chars or sys.maxsize)
        return self._prompter.prompt(messages, tools, self._prompter.variables_read(variables))

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               arrival_time: float | None = None, key: Hashable | None = None) -> Hashable:
        """Queue a request now, past any window; its key (by default its request id)."""
        try:
            request_id = self.engine.add_request(prompt, params, arrival_time=arrival_time).id
        except ValueError as err:
            self._n_refused += 1
            request_id = -self._n_refused
            self._refused.append(refused(request_id, str(err), self.engine.clock()))
        self._keys[request_id] = request_id if key is None else key
        return self._keys[request_id]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one prompt, yielding its text as it is made. Raises ValueError for a prompt that cannot run."""
        request_id = self.engine.add_request(prompt, params, stream_interval=1).id
        while True:
            for output in self._tick():
                if output.request_id != request_id:
                    continue
                if output.text:
                    yield output.text
                if output.finished:
                    return

    def _tick(self) -> list[RequestOutput]:
        refused_now, self._refused = self._refused, []
        return refused_now + (self.engine.step() if self.engine.has_work else [])

    def _feed(self) -> None:
        engine, window = self.engine, self.window
        while self._backlog and (window is None or engine.n_queued < window):
            item = self._backlog.popleft()
            self.submit(item.prompt, item.params, arrival_time=item.arrival_time, key=item.key)
