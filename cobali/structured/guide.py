"""Sampling under constraints: each constrained row's logits masked to the tokens its grammar allows next, and
each sampled token fed back to the grammar.

The mask is applied to the logits in place, so whatever samples the row next (a llama.cpp sampler chain reads
the same buffer) draws from the allowed tokens only: the grammar-first distribution exactly, at any top-k,
top-p or temperature. The rows are put back afterwards: reported logprobs are the model's own.
"""

from __future__ import annotations

import numpy as np
from llguidance import LLMatcher

from cobali.structured.compiler import GrammarCompiler, brief


class Guide:
    def __init__(self, compiler: GrammarCompiler, n_vocab: int) -> None:
        self.compiler = compiler
        self.n_vocab = n_vocab
        self._matchers: dict[int, LLMatcher] = {}
        self._mask = np.zeros((1, (n_vocab + 31) // 32), dtype=np.int32)

    def constrain(self, logits: np.ndarray, rows: list[tuple[int, int, str]]
                  ) -> tuple[list[tuple[int, np.ndarray]], dict[int, Exception]]:
        """rows: (request id, its row of `logits`, its grammar). Masks each row in place; returns the rows as
        they were (for restore) and the requests whose grammar cannot go on (no token allowed, or an error)."""
        saved: list[tuple[int, np.ndarray]] = []
        failures: dict[int, Exception] = {}
        mask = self._mask_for(len(rows))
        for i, (request_id, out_row, grammar) in enumerate(rows):
            try:
                matcher = self._matcher(request_id, grammar)
                matcher.unsafe_compute_mask_ptr(mask[i].ctypes.data, mask.shape[1] * 4)
                if matcher.is_error():
                    self.compiler.forget(grammar)
                    raise ValueError(f"the constraint failed: {brief(matcher.get_error())}")
                allowed = np.unpackbits(mask[i].view(np.uint8), bitorder="little", count=self.n_vocab).view(bool)
                if not allowed.any():
                    raise ValueError("the constraint allows no token after the text written so far")
            except ValueError as err:
                failures[request_id] = err
                continue
            row = logits[out_row]
            saved.append((out_row, row.copy()))
            row.fill(-np.inf)  # then the allowed back: a tenth of the time of assigning through the inverted mask
            np.copyto(row, saved[-1][1], where=allowed)
        return saved, failures

    @staticmethod
    def restore(logits: np.ndarray, saved: list[tuple[int, np.ndarray]]) -> None:
        for out_row, values in saved:
            logits[out_row] = values

    def accept(self, request_id: int, token: int, grammar: str) -> ValueError | None:
        """Feed a sampled token to the request's grammar; the error if the grammar refuses it."""
        matcher = self._matchers[request_id]
        if matcher.consume_token(token):
            return None
        self.compiler.forget(grammar)
        return ValueError(f"the constraint refused the sampled token: {brief(matcher.get_error())}")

    def forget(self, request_id: int) -> None:
        self._matchers.pop(request_id, None)

    def _matcher(self, request_id: int, grammar: str) -> LLMatcher:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            matcher = self._matchers[request_id] = self.compiler.matcher(grammar)
        return matcher

    def _mask_for(self, n_rows: int) -> np.ndarray:
        if len(self._mask) < n_rows:
            self._mask = np.zeros((n_rows, self._mask.shape[1]), dtype=np.int32)
        return self._mask
