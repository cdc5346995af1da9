"""Greedy tokens picked inside llama.cpp's compute graph (its experimental backend sampling, llama_set_sampler).

A sequence with a sampler chain attached gets its token from an argmax node of the graph; llama.cpp then
copies no logits to its logits buffer for a micro-batch whose every output row is such a sequence's, and for a
GPU build keeps them on the device. Rows of other sequences in the same micro-batch still get all logits copied
(every row's). Attaching or detaching makes llama.cpp re-reserve its compute graph at the next decode
(milliseconds), so a sequence stays attached while the requests that run on it need only argmax, and changes
only when one that reads logits arrives on it.

The chain is token-only: llama.cpp's greedy sampler, then a step that drops the logits from the graph's
sampling outputs. The greedy sampler alone leaves them there, and llama.cpp then copies every picked row's
logits into its sampling buffer, one copy per row (llama-graph.cpp, build_sampling: a sampler's outputs
still set after its chain are copied; docs/results.md, "Passes per tick"). The step is a Python callback,
run once per picked row whenever llama.cpp builds a graph (not when it reuses one): each call takes the GIL,
so a build waits on any other thread running Python then.
"""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as ll
import numpy as np

from cobali.backends.base import WANT_ARGMAX

log = logging.getLogger(__name__)


@ll.llama_sampler_i_backend_init
def _supported_everywhere(_sampler, _buffer_type, _n_outputs_max_per_seq) -> bool:
    return True  # the step adds no node to the graph


@ll.llama_sampler_i_backend_apply
def _drop_logits(_sampler, _ggml_ctx, _graph, data) -> None:
    # build_sampling copies a row's logits into the sampling buffer only where the chain left them set.
    data.contents.logits = None


# No host callbacks: a chain skips a member without `apply`, `clone` and `free` may be NULL for a sampler
# without state (llama.h), and llama.cpp names the chain, never its members. The struct and its callbacks live
# as long as the module: llama.cpp keeps pointers to them.
_LOGITS_DROPPING_STEP = ll.llama_sampler_i(backend_init=_supported_everywhere, backend_apply=_drop_logits)


def greedy_chain(token_only: bool = True):
    """A new sampler chain picking the argmax in the graph; token_only=False leaves the logits among its
    outputs, as llama.cpp's greedy sampler alone does (for comparing the two)."""
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
    if token_only:
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init(ctypes.pointer(_LOGITS_DROPPING_STEP), None))
    return chain


class DeviceGreedy:
    """Keeps a greedy chain attached to exactly the sequences whose output rows are WANT_ARGMAX, and reads
    their tokens after the decode."""

    def __init__(self, ctx, n_seq_max: int, token_only: bool = True) -> None:
        self.ctx = ctx
        self.token_only = token_only  # see greedy_chain
        self._chains: dict[int, object] = {}  # seq_id -> its attached chain (llama.cpp borrows it)
        self._attached = np.zeros(n_seq_max, dtype=bool)
        self.supported = True  # False once llama.cpp refused a chain: every row then takes the host path
        # The last decode's batch rows whose token llama.cpp picked, their output (logits) rows, and the output
        # rows left to the host. Worked out before the decode: right after it the caches are cold, and each
        # numpy call costs more than reading the tokens themselves (docs/results.md, "Host path").
        self._rows: list[int] = []
        self._out_rows = np.zeros(0, dtype=np.intp)
        self._host_rows = np.zeros(0, dtype=np.intp)
        self.n_attach_changes = 0  # attaches plus detaches: each costs a graph re-reserve

    def prepare(self, seq_ids: np.ndarray, want_logits: np.ndarray) -> None:
        """Before a decode of these rows: attach or detach chains so that exactly the rows asking for their
        argmax only are picked on the device."""
        outputs = np.flatnonzero(want_logits)
        seqs = seq_ids[outputs]
        on_device = want_logits[outputs] == WANT_ARGMAX
        changed = self._attached[seqs] != on_device
        if self.supported and changed.any():
            for seq in np.unique(seqs[changed & on_device]).tolist():
                if self.supported:
                    self._attach(seq)
            # After the attaches: a sequence with rows of both kinds (never planned) ends up detached.
            for seq in np.unique(seqs[~on_device & self._attached[seqs]]).tolist():
                self._detach(seq)
        picked = on_device & self._attached[seqs]
        self._rows = outputs[picked].tolist()
        self._out_rows, self._host_rows = np.flatnonzero(picked), np.flatnonzero(~picked)

    @property
    def picked_rows(self) -> list[int]:
        """The last decode's batch rows whose token llama.cpp picked."""
        return self._rows

    @property
    def picked_out_rows(self) -> np.ndarray:
        """The last decode's output (logits) rows whose token llama.cpp picked."""
        return self._out_rows

    def tokens(self, logits: np.ndarray) -> np.ndarray:
        """Every output row's greedy token: llama.cpp's pick where it made one, else the host's argmax."""
        if not self._rows:
            return logits.argmax(axis=1)
        get = ll.llama_get_sampled_token_ith
        tokens = [get(self.ctx, row) for row in self._rows]
        assert min(tokens) >= 0, "llama.cpp picked no token for a sequence with a chain attached"
        if not len(self._host_rows):
            return np.array(tokens)
        best = np.empty(len(logits), dtype=np.int64)
        best[self._host_rows] = logits[self._host_rows].argmax(axis=1)
        best[self._out_rows] = tokens
        return best

    def _attach(self, seq: int) -> None:
        chain = greedy_chain(self.token_only)
        if not ll.llama_set_sampler(self.ctx, seq, chain):
            ll.llama_sampler_free(chain)
            self.supported = False
            log.warning("llama.cpp cannot sample on this backend: greedy tokens stay on the host")
            self.close()
            return
        self._chains[seq] = chain
        self._attached[seq] = True
        self.n_attach_changes += 1

    def _detach(self, seq: int) -> None:
        ll.llama_set_sampler(self.ctx, seq, None)
        # A chain cannot be attached twice (llama.cpp asserts): the next attach makes a new one.
        ll.llama_sampler_free(self._chains.pop(seq))
        self._attached[seq] = False
        self.n_attach_changes += 1

    def close(self) -> None:
        """Detach and free every chain (before the context is freed)."""
        for seq in list(self._chains):
            self._detach(seq)
