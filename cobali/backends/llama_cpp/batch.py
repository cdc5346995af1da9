"""The llama_batch the engine fills in place, and the one call that decodes it."""

from __future__ import annotations

import ctypes

import llama_cpp as ll
import numpy as np

from cobali.backends.base import BatchArrays, DecodeError

DECODE_ERRORS = {1: "no KV slot for the batch (KV cache full)", 2: "decode aborted"}


def decode_batch(ctx, batch: OwnedBatch) -> None:
    code = ll.llama_decode(ctx, batch.struct)
    if code != 0:
        raise DecodeError(DECODE_ERRORS.get(code, f"llama_decode returned {code}"), code)



class OwnedBatch:
    """A llama_batch whose arrays are numpy buffers: the engine fills them in place (BatchArrays).

    llama_batch_init gives each row its own malloc'd seq_id array, which cannot be filled in one numpy
    operation; here every row's seq_id pointer points into one contiguous int32 array instead.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.arrays = a = BatchArrays.zeros(capacity)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        seq_base = a.seq_ids.ctypes.data
        self.seq_ptrs = (ctypes.POINTER(ll.llama_seq_id) * capacity)(
            *(ctypes.cast(seq_base + 4 * i, ctypes.POINTER(ll.llama_seq_id)) for i in range(capacity))
        )
        # llama_cpp annotates llama_batch's pointer fields as arrays (pos as an array of arrays): its typing is wrong.
        self.struct = ll.llama_batch()
        self.struct.token = a.tokens.ctypes.data_as(ctypes.POINTER(ll.llama_token))  # type: ignore[assignment]
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()  # type: ignore[assignment]
        self.struct.pos = a.positions.ctypes.data_as(ctypes.POINTER(ll.llama_pos))  # type: ignore[assignment]
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))  # type: ignore[assignment]
        self.struct.seq_id = self.seq_ptrs  # type: ignore[assignment]
        self.struct.logits = a.want_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))  # type: ignore[assignment]

    def fill(self, tokens, positions, seq_ids, want_logits) -> int:
        """Point the batch at its first n rows, copying only inputs that are not already views of them."""
        n = len(tokens)
        assert 0 < n <= self.capacity, f"batch of {n} rows for a capacity of {self.capacity}"
        a = self.arrays
        # A view of an array here is of its first rows (BatchArrays' contract), as the engine hands them: checked
        # by its base, which costs a tenth of comparing data pointers (.ctypes builds an object per access).
        for own, given in ((a.tokens, tokens), (a.positions, positions), (a.seq_ids, seq_ids),
                           (a.want_logits, want_logits)):
            if getattr(given, "base", None) is not own:
                own[:n] = given
        self.struct.n_tokens = n
        return n
