"""What llama.cpp did in each decode, counted by llama.cpp's own hooks (LlamaCppConfig.count_decodes): forward
passes, graph reuses, and the logits rows it copied to the host. For tests and benchmarks: the hooks add host
work to every decode (a Python call per graph node, a poisoned logits buffer scanned after).

- Passes: a graph eval callback (cb_eval) sees every node of every graph llama.cpp computes, one graph per
  micro-batch; each graph has one final norm ("result_norm", in every decoder architecture).
- Graph reuses: llama_perf_context's n_reused, counted whatever no_perf says.
- Raw logits rows: llama.cpp copies a micro-batch's logits rows only where one of its output rows is of a
  sequence without a backend sampler (needs_raw_logits). The rows are poisoned with NaN before the decode;
  after it, a row still NaN, or zero (a grown buffer starts cleared), was not copied. A decode with more
  output rows than the buffer was known to hold, which llama.cpp did not grow, leaves the count unknown.
- Sampled logits rows: rows whose token llama.cpp's backend sampler picked, and whose logits it still copied
  into its sampling buffer (llama_get_sampled_logits_count_ith > 0).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import llama_cpp as ll
import numpy as np

GRAPH_MARKER = b"result_norm"  # one node per forward pass


@dataclass(frozen=True)
class DecodeCounts:
    passes: int  # graphs computed: micro-batches
    graphs_reused: int  # of those, graphs llama.cpp reused from the previous pass instead of building
    raw_logits_rows: int | None  # output rows whose logits were copied to the host's logits buffer
    sampled_logits_rows: int  # rows sampled in the graph whose logits were still copied (its sampling buffer)


class DecodeCounter:
    """Counts each decode of one context; `eval_callback` goes into its params when it is made."""

    def __init__(self, n_seq_max: int) -> None:
        self.eval_callback = ll.ggml_backend_sched_eval_callback(self._on_node)  # alive while the context is
        self._name_of = ll.llama_cpp._lib.ggml_get_name  # ggml's, reached through libllama's dependencies
        self._name_of.argtypes, self._name_of.restype = [ctypes.c_void_p], ctypes.c_char_p
        self._passes = self._reused_before = 0
        self._rows_held = n_seq_max  # logits rows the output buffer surely holds: it grows, never shrinks
        self._poisoned: np.ndarray | None = None
        self.decodes: list[DecodeCounts] = []

    def _on_node(self, tensor: int, ask: bool, _user_data: int) -> bool:
        if ask and self._name_of(tensor) == GRAPH_MARKER:
            self._passes += 1
        return False  # no node's data is wanted: each graph computes in one piece, as without the callback

    def before_decode(self, ctx, n_outputs: int) -> None:
        self._passes = 0
        self._reused_before = ll.llama_perf_context(ctx).n_reused
        self._poisoned = _logits_rows(ctx, min(n_outputs, self._rows_held))
        if self._poisoned is not None:
            self._poisoned[:] = np.nan

    def after_decode(self, ctx, n_outputs: int, sampled_rows: list[int]) -> DecodeCounts:
        """`sampled_rows`: the batch rows whose token the backend sampler picked."""
        logits = _logits_rows(ctx, n_outputs)
        copied: int | None = 0
        if logits is not None:
            same_buffer = self._poisoned is not None and self._poisoned.ctypes.data == logits.ctypes.data
            copied = (None if same_buffer and n_outputs > self._rows_held
                      else int(np.count_nonzero(~np.isnan(logits[:, 0]) & logits.any(axis=1))))
        self._rows_held = max(self._rows_held, n_outputs)
        sampled = sum(ll.llama_get_sampled_logits_count_ith(ctx, row) > 0 for row in sampled_rows)
        counts = DecodeCounts(self._passes, ll.llama_perf_context(ctx).n_reused - self._reused_before, copied,
                              sampled)
        self.decodes.append(counts)
        return counts


def _logits_rows(ctx, n_rows: int) -> np.ndarray | None:
    pointer = ll.llama_get_logits(ctx)
    if not pointer or n_rows == 0:
        return None
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(ll.llama_get_model(ctx)))
    return np.ctypeslib.as_array(pointer, shape=(n_rows, n_vocab))
