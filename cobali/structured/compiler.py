"""llguidance grammars compiled against one vocabulary, under the operator's limits, and kept for reuse.

The server compiles a request's grammar on its worker pool before the request is queued (a bad or too costly
grammar is that request's 400); the engine thread then takes a copy of the compiled matcher when the request
first samples. llguidance drops the GIL while it compiles, so a long compile stalls neither the event loop nor
the engine's ticks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer

from cobali.structured.limits import GrammarLimits

CACHE_SIZE = 128  # compiled grammars kept: a copy of one costs far less than compiling it again


class GrammarCompiler:
    def __init__(self, tokenizer: Callable[[], LLTokenizer], limits: GrammarLimits | None = None) -> None:
        """tokenizer: builds the vocabulary's llguidance tokenizer, on first use (it reads every token): a
        Vocabulary's guidance_tokenizer, the engine's backend's or the frontend's own."""
        self.limits = limits = limits or GrammarLimits()
        self._make_tokenizer = tokenizer
        self._tokenizer: LLTokenizer | None = None
        self._ll_limits = LLParserLimits(
            max_grammar_size=limits.max_grammar_size, max_lexer_states=limits.max_lexer_states,
            initial_lexer_fuel=limits.initial_lexer_fuel, step_lexer_fuel=limits.step_lexer_fuel,
            step_max_items=limits.step_max_items, verbose_errors=False)  # no parser state in a client's error
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Compile `grammar` (or find it compiled); ValueError saying why it cannot be used."""
        self._template(grammar)

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher for one request, at the grammar's start."""
        return self._template(grammar).deep_copy()

    def forget(self, grammar: str) -> None:
        """Drop a compiled grammar: its copies share one lexer and its limits, so once one of them ran out, the
        next request compiles afresh instead of failing at its first token."""
        with self._lock:
            self._compiled.pop(grammar, None)

    def _check_start(self, template: LLMatcher) -> None:
        """Some grammars compile yet allow nothing at all (a $ref cycle that reaches no value): the first mask
        says so, here rather than at the request's first token."""
        probe = template.deep_copy()
        mask = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        probe.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if probe.is_error() or not mask.any():
            raise ValueError(f"the constraint allows no output ({brief(probe.get_error()) or 'nothing first'})")

    def _template(self, grammar: str) -> LLMatcher:
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                return template
        template = LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._ll_limits)
        if template.is_error():
            raise ValueError(f"the constraint cannot be used: {brief(template.get_error())}")
        self._check_start(template)
        with self._lock:
            self._compiled[grammar] = template
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template


def brief(error: str, limit: int = 500) -> str:
    """llguidance's error for a client: on one line, without the marker its terse mode adds, and bounded (a
    schema's 4,000-digit bound would come back whole)."""
    line = " ".join(error.replace("<non-verbose/>", "").split())
    return line if len(line) <= limit else line[:limit] + "..."
