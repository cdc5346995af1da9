"""What KV a replica holds, as a bounded digest a router can read, and a prompt hashed the same way.

The engine's prefix cache compares whole token arrays (its keys, Request.kv_key: a cache_salt's marks and a LoRA
adapter's range are in them already). A router in another process cannot hold every replica's arrays, so both
sides cut the keys into blocks of `block_tokens` and chain a hash over them: block i's hash stands for the first
(i + 1) * block_tokens keys, whatever comes after. A replica publishes the hashes of the prefixes it holds
(Engine.held_prefixes), at most `max_blocks` of them, the most recently used prefixes first (the engine core's
RoutingReport); a router hashes a prompt's blocks (prompt_blocks) and counts how many of them, from the first, a
replica's set holds. Each prefix goes in from its first block, so a set never holds a block without those before
it. Both sides are here, in the engine: a frontend and a router may import the engine, never the other way.

A collision of two hashes only misroutes a request: the engine still compares the tokens themselves.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from cobali.engine.kv_tier import KEY_DTYPE
from cobali.engine.request import Request
from cobali.engine.sampling_params import SamplingParams

_KEY_BYTES = np.dtype(KEY_DTYPE).itemsize
_ROOT = bytes(8)  # the key of the first block's hash


def block_hashes(keys: np.ndarray | Sequence[int], block_tokens: int, after: int | None = None) -> list[int]:
    """The chained hashes of the whole blocks of `keys`: the i-th is a keyed BLAKE2b of block i under the (i-1)-th
    (8 bytes: as stable across processes and machines as the keys are). after: the hash of the block before
    `keys` begin, when they go on from one."""
    assert block_tokens > 0
    array = np.asarray(keys, dtype=KEY_DTYPE)
    raw = array[: len(array) // block_tokens * block_tokens].astype("<i8", copy=False).tobytes()
    step = block_tokens * _KEY_BYTES
    chain, hashes = _ROOT if after is None else after.to_bytes(8, "little"), []
    for start in range(0, len(raw), step):
        chain = hashlib.blake2b(raw[start : start + step], digest_size=8, key=chain).digest()
        hashes.append(int.from_bytes(chain, "little"))
    return hashes


def prompt_blocks(tokens: Sequence[int], block_tokens: int, cache_salt: str | None = None,
                  lora: int = 0) -> list[int]:
    """A prompt's block hashes as a replica holding its KV would publish them: of its keys as the engine makes them
    (Request.kv_key), but the last token, which the engine always computes (its logits are sampled)."""
    params = SamplingParams(cache_salt=cache_salt)
    keys = Request(0, list(tokens), params, arrival_time=0.0, lora=lora).kv_key(max(len(tokens) - 1, 0))
    return block_hashes(keys, block_tokens)


class GrowingKeys(NamedTuple):
    """A running request's keys: its first n_tokens, which only grow while it runs (a preempted request's come
    back the same), so a digest hashes only the blocks they gained since the last one."""

    request_id: int
    n_tokens: int
    keys: Callable[[int, int], list[int]]  # (stop, start): the keys in [start, stop), Request.kv_key


class DigestBuilder:
    """A replica's digests, one after another: the hashes of held prefixes it saw in the last digest are reused
    (the free slots' and host memory's arrays outlive many digests, by identity; a running request's blocks, by
    its id, hashing only the blocks it gained)."""

    def __init__(self, block_tokens: int, max_blocks: int) -> None:
        if block_tokens < 1 or max_blocks < 1:
            raise ValueError(f"block_tokens and max_blocks must be >= 1, got {block_tokens} and {max_blocks}")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        # id(array) -> (the array, its hashes). The array is kept, so its id is not reused while it is here; only
        # the last digest's arrays stay, so this holds no more than the engine did then.
        self._memo: dict[int, tuple[np.ndarray, list[int]]] = {}
        self._running: dict[int, list[int]] = {}  # request id -> its blocks' hashes so far (the last digest's)
        self.hashed_blocks = 0  # blocks hashed, for the tests and the bench: memo hits cost none

    def digest(self, prefixes: Iterable[np.ndarray | GrowingKeys]) -> list[int]:
        """The hashes of `prefixes` (most valuable first), each from its first block, until max_blocks are in: in
        that order, each once."""
        memo, self._memo = self._memo, {}
        running, self._running = self._running, {}
        held: dict[int, None] = {}  # insertion-ordered: the cap keeps the first prefixes' blocks
        for keys in prefixes:
            if len(held) >= self.max_blocks:
                break
            if isinstance(keys, GrowingKeys):
                hashes = self._grown(keys, running.get(keys.request_id, []))
                self._running[keys.request_id] = hashes
            else:
                hashes = self._hashed(keys, memo.get(id(keys)))
                self._memo[id(keys)] = (keys, hashes)
            for block in hashes:
                if block not in held:
                    if len(held) == self.max_blocks:
                        break
                    held[block] = None
        return list(held)

    def _hashed(self, keys: np.ndarray, seen: tuple[np.ndarray, list[int]] | None) -> list[int]:
        if seen is not None and seen[0] is keys:
            return seen[1]
        hashes = block_hashes(keys, self.block_tokens)
        self.hashed_blocks += len(hashes)
        return hashes

    def _grown(self, keys: GrowingKeys, before: list[int]) -> list[int]:
        whole = keys.n_tokens // self.block_tokens
        if whole <= len(before):
            return before[:whole]
        start = len(before) * self.block_tokens
        added = block_hashes(keys.keys(whole * self.block_tokens, start), self.block_tokens,
                             after=before[-1] if before else None)
        self.hashed_blocks += len(added)
        return before + added
