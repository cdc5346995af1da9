"""Which running requests a new prompt may copy KV from, found without a pass over all of them.

A running request is a prefix source for a new prompt only if the two share at least the first min_reuse_tokens
tokens (a shorter prefix is never reused), under the same cache_salt and adapter. So the running requests are
kept in buckets by those first tokens: an admission looks in one bucket, not at hundreds of running requests.
A bucket may still hold hundreds (one system prompt opening every chat), and each look builds the source's
keys, as long as its context: an admission reads at most MAX_SOURCES of them, the longest-running first, so its
cost does not grow with the slot count. They are interchangeable for the shared part, which is what a burst of
chats on one system prompt (or one prompt sampled n times) shares; a conversation's own earlier turn is found
in a free slot's cached prefix, not here.

Requests whose prompt is shorter than min_reuse_tokens are in no bucket: their first tokens change as they
generate, and what they could lend (their prompt and a little output) is seldom what another prompt opens with.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from cobali.engine.request import Request

MAX_SOURCES = 8
MAX_LOOKS = 4 * MAX_SOURCES

_Head = tuple[str | None, int, tuple[int, ...]]


class RunningPrefixes:
    def __init__(self, min_reuse_tokens: int) -> None:
        assert min_reuse_tokens > 0
        self.min_reuse_tokens = min_reuse_tokens
        # head -> its running requests, by id, in admission order (dicts keep it, and drop one in O(1)).
        self._buckets: dict[_Head, dict[int, Request]] = {}

    def _head(self, request: Request) -> _Head | None:
        prompt = request.prompt_tokens
        if len(prompt) < self.min_reuse_tokens:
            return None
        return request.params.cache_salt, request.lora, tuple(prompt[: self.min_reuse_tokens])

    def add(self, request: Request) -> None:
        head = self._head(request)
        if head is not None:
            self._buckets.setdefault(head, {})[request.id] = request

    def discard(self, request: Request) -> None:
        head = self._head(request)
        if head is None:
            return
        bucket = self._buckets.get(head)
        if bucket is not None and bucket.pop(request.id, None) is not None and not bucket:
            del self._buckets[head]

    def sources_for(self, request: Request, skip: Collection[int]) -> Iterator[Request]:
        """The running requests, at most MAX_SOURCES, whose KV opens with `request`'s first tokens (all of its
        tokens, prompt and any output, as its KV will be keyed): ids in `skip` (admitted this tick, their KV
        not computed yet) left out."""
        tokens = request.all_tokens
        if len(tokens) < self.min_reuse_tokens:
            return
        bucket = self._buckets.get((request.params.cache_salt, request.lora, tuple(tokens[: self.min_reuse_tokens])))
        if not bucket:
            return
        read = 0
        # Those that cannot lend yet (admitted this tick, or still short of min_reuse_tokens computed) are the
        # newest, at the bucket's end: a look past a few times MAX_SOURCES would find no other.
        for looked, source in enumerate(bucket.values()):
            if looked == MAX_LOOKS:
                return
            if source.slot is None or source.id in skip or source.computed_tokens < self.min_reuse_tokens:
                continue
            yield source
            read += 1
            if read == MAX_SOURCES:
                return
