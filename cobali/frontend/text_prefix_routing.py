"""A router that guesses where a prompt's KV is from the text it sent each replica: the approximate policy.

What Ray Serve LLM's PrefixCacheAffinityRouter is documented to do, written here from that description: the router
keeps, per replica, a character-level prefix tree of the texts it routed there. When the queues of requests are
balanced (the longest exceeds the shortest by no more than `imbalance`), the replica whose tree matches the most of
the text's leading characters wins if it matches at least `match_rate` of them; below that, the replica with the
smallest tree (the least cache it is thought to hold). When they are imbalanced, two replicas drawn at random, the
shorter queue taking the request: no prompt can pin all traffic to one replica. A session's last replica wins a
tie. The text then goes into the chosen replica's tree.

It knows nothing the replicas hold: only what it sent them (frontend/prefix_routing.py routes by what they report).

Memory is bounded: each tree holds at most `max_chars` characters, a node counted as _NODE_CHARS of them beside its
edge's (about the bytes its object and its dict of children take: so a text cut into one-character nodes cannot hold
ten times the memory that prose does); past that its least recently routed leaves go first, as an engine's prefix
cache drops its least recently used prefixes. Cost is linear in the text per replica: a match compares each
character of the text at most once per tree, and an edge holds at most _EDGE characters, so splitting one copies no
more than that; an eviction's steps are paid for by the characters inserted before it.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from cobali.frontend.prefix_routing import ReplicaLoad, Sessions, two_choices

K = TypeVar("K", bound=Hashable)  # how the caller names a replica: an index in the simulator, a replica id in Ray
_EDGE = 1024  # characters in one edge at most: what a split copies
_NODE_CHARS = 256  # what a node costs beside its edge's characters, counted against max_chars
_CHUNK = 64  # characters compared at once when looking for where an edge and a text part


@dataclass(frozen=True)
class TextRoutingConfig:
    match_rate: float = 0.1  # Ray's: a best match below this share of the text counts as none
    imbalance: int = 10  # Ray's: queues further apart than this route by power of two
    max_chars: int = 1 << 20  # characters held in one replica's tree, each node counted as _NODE_CHARS more
    max_sessions: int = 65536

    def __post_init__(self) -> None:
        if not 0 <= self.match_rate <= 1:
            raise ValueError(f"match_rate must be in [0, 1], got {self.match_rate}")
        if self.imbalance < 0:
            raise ValueError(f"imbalance must be >= 0, got {self.imbalance}")
        if min(self.max_chars, self.max_sessions) < 1:
            raise ValueError(f"max_chars and max_sessions must be >= 1, got {self.max_chars}, {self.max_sessions}")


class _Node:
    __slots__ = ("children", "edge", "parent", "stamp")

    def __init__(self, edge: str, parent: _Node | None, stamp: int) -> None:
        self.edge = edge  # the characters from the parent to here
        self.parent = parent  # None: the root, or a node evicted
        self.children: dict[str, _Node] = {}  # by the first character of their edge
        self.stamp = stamp  # the last route through here: never older than any node below


class _Tree:
    """One replica's texts. `ops` counts the steps taken (characters compared, nodes visited, heap entries), for
    the tests: what the linear cost is checked by."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.root = _Node("", None, 0)
        self.chars = 0
        self.nodes = 0  # but the root
        self.ops = 0
        # Leaves by stamp, least recent first; an entry whose node has moved on (touched since, grown children,
        # evicted) is skipped when popped, and the heap rebuilt once such entries outnumber the nodes.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._pushed = 0  # a tie-break: nodes do not compare

    def _common(self, edge: str, text: str, pos: int) -> int:
        """How many leading characters of `edge` text has from pos."""
        if text.startswith(edge, pos):
            self.ops += len(edge)
            return len(edge)
        n, i = min(len(edge), len(text) - pos), 0
        while i < n:
            step = min(_CHUNK, n - i)
            self.ops += step
            if edge[i : i + step] != text[pos + i : pos + i + step]:
                while edge[i] == text[pos + i]:  # they differ within this chunk
                    i += 1
                return i
            i += step
        return n

    def _walk(self, text: str) -> tuple[_Node, int, _Node | None, int]:
        """(the deepest node text passes whole, the characters to it, the child it stops in or None, the
        characters of that child's edge it matches)."""
        node, pos = self.root, 0
        while pos < len(text):
            self.ops += 1
            child = node.children.get(text[pos])
            if child is None:
                break
            n = self._common(child.edge, text, pos)
            if n < len(child.edge):
                return node, pos, child, n
            node, pos = child, pos + n
        return node, pos, None, 0

    def match(self, text: str) -> int:
        """The leading characters of `text` this tree holds."""
        _, pos, _, n = self._walk(text)
        return pos + n

    def insert(self, text: str, stamp: int) -> None:
        """Hold `text` (its first max_chars characters), stamped, then evict down to max_chars."""
        text = text[: self.max_chars]
        node, pos, child, n = self._walk(text)
        if child is not None:  # split child's edge where the text leaves it
            self.ops += len(child.edge)  # the copy
            mid = _Node(child.edge[:n], node, child.stamp)
            node.children[mid.edge[0]] = mid
            child.edge, child.parent = child.edge[n:], mid
            mid.children[child.edge[0]] = child
            node, pos = mid, pos + n
            self.nodes += 1
        for start in range(pos, len(text), _EDGE):
            leaf = _Node(text[start : start + _EDGE], node, stamp)
            node.children[leaf.edge[0]] = leaf
            node = leaf
            self.chars += len(leaf.edge)
            self.nodes += 1
            self.ops += 1
        end: _Node | None = node
        while end is not None:  # the path from the root is now the most recent
            end.stamp = stamp
            end = end.parent
            self.ops += 1
        if not node.children and node is not self.root:
            self._push(node)
        self._evict()

    def _push(self, leaf: _Node) -> None:
        if len(self._leaves) > 2 * self.nodes + 64:
            self._rebuild()
        self._pushed += 1
        self.ops += 1
        heapq.heappush(self._leaves, (leaf.stamp, self._pushed, leaf))

    def _rebuild(self) -> None:
        stack, leaves = [self.root], []
        while stack:
            node = stack.pop()
            self.ops += 1
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                self._pushed += 1
                leaves.append((node.stamp, self._pushed, node))
        heapq.heapify(leaves)
        self._leaves = leaves

    @property
    def size(self) -> int:
        """What max_chars caps."""
        return self.chars + _NODE_CHARS * self.nodes

    def _evict(self) -> None:
        while self.size > self.max_chars:
            stamp, _, leaf = heapq.heappop(self._leaves)
            self.ops += 1
            parent = leaf.parent
            if parent is None or leaf.children or leaf.stamp != stamp:
                continue  # stale
            del parent.children[leaf.edge[0]]
            leaf.parent = None
            self.chars -= len(leaf.edge)
            self.nodes -= 1
            if not parent.children and parent is not self.root:
                self._push(parent)


class TextPrefixRouter(Generic[K]):
    """Picks a replica for each request; deterministic given its seed and the order of the loads it is handed."""

    def __init__(self, config: TextRoutingConfig, seed: int = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._trees: dict[K, _Tree] = {}
        self._sessions: Sessions[K] = Sessions(config.max_sessions)
        self._routed = 0  # the stamp of the next route
        self.balanced = 0  # requests routed by load alone, the queues being imbalanced

    def forget(self, replica: K) -> None:
        """A replica gone: its tree dropped (it starts empty if it comes back in the loads)."""
        self._trees.pop(replica, None)

    def held_chars(self, replica: K) -> int:
        """The size of `replica`'s tree, as max_chars counts it."""
        tree = self._trees.get(replica)
        return tree.size if tree is not None else 0

    @property
    def ops(self) -> int:
        """Steps taken in all the trees so far (tests count them)."""
        return sum(tree.ops for tree in self._trees.values())

    def route(self, text: str, loads: Mapping[K, ReplicaLoad], session: str | None = None) -> K:
        """The replica for a prompt whose text (as rendered, or its messages' contents in order) is `text`."""
        if not loads:
            raise ValueError("no replica to route to")
        queues = [load.queue for load in loads.values()]
        if max(queues) - min(queues) > self.config.imbalance:
            self.balanced += 1
            picked = two_choices(loads, self._rng)
        else:
            picked = self._by_prefix(text, loads, session)
        self._routed += 1
        tree = self._trees.get(picked)
        if tree is None:
            tree = self._trees[picked] = _Tree(self.config.max_chars)
        tree.insert(text, self._routed)
        self._sessions.remember(session, picked)
        return picked

    def _by_prefix(self, text: str, loads: Mapping[K, ReplicaLoad], session: str | None) -> K:
        matched = {replica: self._trees[replica].match(text) if replica in self._trees else 0 for replica in loads}
        top = max(matched.values())
        if text and top >= self.config.match_rate * len(text):
            best = [replica for replica, n in matched.items() if n == top]
        else:
            smallest = min(self.held_chars(replica) for replica in loads)
            best = [replica for replica in loads if self.held_chars(replica) == smallest]
        return self._sessions.pick(best, session, self._rng)
