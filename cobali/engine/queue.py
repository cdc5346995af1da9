"""The waiting queue: FIFO, by priority, or shortest prompt first with aging; preempted requests first,
bounded head-of-line bypass."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cobali.engine.request import Request

QUEUE_ORDERS = ("fifo", "priority", "srpf")


@dataclass(frozen=True)
class ShortestPromptFirst:
    """Shortest remaining prompt first, with aging (after SLAI and Sarathi-Serve's discussions of prefill
    order). A request ranks at its arrival time plus `s_per_token` for each prompt token still to compute:
    a short prompt goes ahead of a long one that arrived less than the difference's worth of seconds
    earlier, and a long prompt waits at most its own length's worth behind any later arrival, so none
    starves. The default is about one prefill token's cost on a 2-core CPU; on a GPU, where prefill is far
    faster, a smaller value keeps the order closer to arrival."""

    s_per_token: float = 0.003

    def rank(self, request: Request) -> float:
        return request.arrival_time + self.s_per_token * request.uncached_tokens


class WaitQueue:
    """Requests waiting for a slot.

    Order: preempted requests (they already streamed tokens) first, then by priority (lower value
    first, only with order="priority"), then by ShortestPromptFirst's rank (only with order="srpf"), then
    by arrival; the same rank orders the prompts being prefilled (prefill_order). When the head does not
    fit in KV, a later request that fits may go ahead of it, but the head is passed over at most `max_bypass` times
    (its aging bound); after that nothing is admitted until the head fits.
    """

    def __init__(self, order: str = "fifo", max_bypass: int = 8,
                 shortest_first: ShortestPromptFirst | None = None) -> None:
        if order not in QUEUE_ORDERS:
            raise ValueError(f"unknown queue order {order!r}: expected one of {', '.join(QUEUE_ORDERS)}")
        self.order = order
        self.max_bypass = max_bypass
        self.shortest_first = (shortest_first or ShortestPromptFirst()) if order == "srpf" else None
        # Sorted by key; keys are unique, so bisect never compares two requests.
        self._items: list[tuple[tuple[int, int, float, int], Request]] = []
        self._keys: dict[int, tuple[int, int, float, int]] = {}  # request id -> key
        self._seq = itertools.count()
        self._bypassed: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in self._items)

    def __getitem__(self, index: int) -> Request:
        return self._items[index][1]

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request.id in self._keys

    def push(self, request: Request, front: bool = False) -> None:
        assert request.id not in self._keys, f"request {request.id} queued twice"
        priority = request.priority if self.order == "priority" else 0
        rank = self.shortest_first.rank(request) if self.shortest_first and not front else 0.0
        key = (0 if front else 1, priority, rank, -next(self._seq) if front else next(self._seq))
        self._keys[request.id] = key
        bisect.insort(self._items, (key, request), key=lambda item: item[0])

    def remove(self, request: Request) -> None:
        key = self._keys.pop(request.id)
        del self._items[bisect.bisect_left(self._items, key, key=lambda item: item[0])]
        self._bypassed.pop(request.id, None)

    def pop_admissible(self, fits: Callable[[Request], bool]) -> Request | None:
        """The first request that fits, unless the head has been bypassed too often; None otherwise."""
        if not self._items:
            return None
        head = self._items[0][1]
        if fits(head):
            self.remove(head)
            return head
        if self._bypassed.get(head.id, 0) >= self.max_bypass:
            return None
        for _, request in self._items[1:]:
            if fits(request):
                self._bypassed[head.id] = self._bypassed.get(head.id, 0) + 1
                self.remove(request)
                return request
        return None

    def prefill_order(self, prefilling: Iterable[Request]) -> list[Request]:
        """The order in which prompts being prefilled get a tick's budget: admission order, or with "srpf"
        by rank (the remaining prompt shrinks as chunks run, so the rank is read now)."""
        if self.shortest_first is None:
            return list(prefilling)
        return sorted(prefilling, key=self.shortest_first.rank)
