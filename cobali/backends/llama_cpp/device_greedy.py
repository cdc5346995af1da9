"""Greedy tokens picked inside llama.cpp's compute graph (its experimental backend sampling, llama_set_sampler).

A sequence with a sampler chain attached gets its token from an argmax node of the graph; llama.cpp then
copies no logits for a micro-batch whose every output row is such a sequence's, and for a GPU build keeps them
on the device. Rows of other sequences in the same micro-batch still get all logits copied (every row's).
Attaching or detaching makes llama.cpp re-reserve its compute graph at the next decode (milliseconds), so a
sequence stays attached while the requests that run on it need only argmax, and changes only when one that
reads logits arrives on it.
"""

from __future__ import annotations

import logging

import llama_cpp as ll
import numpy as np

from cobali.backends.base import WANT_ARGMAX

log = logging.getLogger(__name__)


class DeviceGreedy:
    """Keeps a greedy chain attached to exactly the sequences whose output rows are WANT_ARGMAX, and reads
    their tokens after the decode."""

    def __init__(self, ctx, n_seq_max: int) -> None:
        self.ctx = ctx
        self._chains: dict[int, object] = {}  # seq_id -> its attached chain (llama.cpp borrows it)
        self._attached = np.zeros(n_seq_max, dtype=bool)
        self.supported = True  # False once llama.cpp refused a chain: every row then takes the host path
        # The last decode's batch rows whose token llama.cpp picked, their output (logits) rows, and the output
        # rows left to the host. Worked out before the decode: right after it the caches are cold, and each
        # numpy call costs ~20 us (measured), more than reading 16 tokens.
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
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
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
