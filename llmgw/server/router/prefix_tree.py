"""An approximate prefix tree: which replica recently served which request text.

The gateway cannot see a replica's KV cache without KV events (issue #6), so it guesses:
a replica that served a request whose text starts with P probably still holds P's KV
blocks. One `PrefixTree` per model is a radix tree over request texts (the prompt, or the
rendered chat messages); every node holds an edge label and, per replica, the last time a
request of that replica covered the whole edge.

Invariants (the property tests walk them):

- a replica present at a node is present at every ancestor, with a time at least as late
  (each insert touches its whole path with the same `now`, and times never go back);
- a node without replicas is removed at once, so every stored node has at least one;
- `size` is the sum of the edge lengths: the characters stored.

`match(text)` walks the text down the tree comparing whole edges as string slices (C
speed, no per-character loop) and reports, per replica, how many leading characters of the
text that replica served: the depth of the deepest node on the path that holds it, or the
point inside a partially matched edge.

Eviction, after sglang-router's approximate tree, re-implemented here:

- size: after an insert leaves more than `max_chars` stored, least recently used
  (replica, leaf) pairs are dropped until `low_watermark * max_chars` remain. A node is a
  leaf *for a replica* when no child holds that replica, so dropping it trims that
  replica's oldest branch tail first while shared prefixes (touched by every request that
  passes through them) stay. Dropping the last replica of a node frees its characters. The
  text just inserted is never evicted by its own insert, so it always matches afterwards;
  a text longer than `max_chars` is stored truncated to `max_chars`.
- age: entries not touched for `max_age_s` are dropped by a sweep that runs from `insert`
  at most every `sweep_interval_s` (default a tenth of `max_age_s`), or when called as
  `evict_expired(now)`; an entry can thus outlive `max_age_s` by up to one interval.

Both sweeps walk the whole tree (O(nodes)); the low watermark amortises the size sweep to
a few node visits per insert. Times are whatever clock the caller uses (monotonic).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

DEFAULT_MAX_CHARS = 4_000_000
DEFAULT_MAX_AGE_S = 600.0
DEFAULT_LOW_WATERMARK = 0.9


class _Node:
    __slots__ = ("children", "edge", "parent", "replicas")

    def __init__(self, edge: str, parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge → child
        self.replicas: dict[str, float] = {}  # replica id → last time it covered this edge


_HeapEntry = tuple[float, int, str, _Node]


class PrefixTree:
    """A radix tree over request texts remembering, per replica, what it served and when."""

    def __init__(
        self,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        sweep_interval_s: float | None = None,
        low_watermark: float = DEFAULT_LOW_WATERMARK,
    ) -> None:
        if max_chars < 1 or max_age_s <= 0 or not 0.0 <= low_watermark <= 1.0:
            raise ValueError("max_chars >= 1, max_age_s > 0 and 0 <= low_watermark <= 1")
        self._max_chars = max_chars
        self._max_age_s = max_age_s
        self._sweep_interval_s = max_age_s / 10 if sweep_interval_s is None else sweep_interval_s
        self._low_chars = int(max_chars * low_watermark)
        self._root = _Node("", None)
        self._size = 0
        self._replica_chars: dict[str, int] = {}
        self._next_sweep = float("-inf")

    @property
    def size(self) -> int:
        """Characters stored (the sum of all edge lengths)."""
        return self._size

    def replica_chars(self, replica_id: str) -> int:
        """Characters of the edges that `replica_id` holds (its share of the tree)."""
        return self._replica_chars.get(replica_id, 0)

    def replicas(self) -> frozenset[str]:
        """Replica ids with at least one stored prefix."""
        return frozenset(self._replica_chars)

    def match(self, text: str) -> dict[str, int]:
        """Per replica, the number of leading characters of `text` it served (absent = 0)."""
        result: dict[str, int] = {}
        node, pos, end = self._root, 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                break
            if text.startswith(child.edge, pos):
                pos += len(child.edge)
                result.update(dict.fromkeys(child.replicas, pos))
                node = child
                continue
            pos += _common_prefix_len(child.edge, text, pos)
            result.update(dict.fromkeys(child.replicas, pos))
            break
        return result

    def insert(self, text: str, replica_id: str, now: float) -> None:
        """Record that `replica_id` served `text` at time `now`, then evict if due."""
        if now >= self._next_sweep:
            self.evict_expired(now)
        text = text[: self._max_chars]
        if not text:
            return
        leaf = self._insert_path(text, replica_id, now)
        if self._size > self._max_chars:
            self._evict_lru(protect=(replica_id, leaf))

    def evict_expired(self, now: float) -> None:
        """Drop every entry not touched since `now - max_age_s`."""
        self._next_sweep = now + self._sweep_interval_s
        cutoff = now - self._max_age_s
        for node in self._post_order():
            for replica_id in [r for r, seen in node.replicas.items() if seen < cutoff]:
                self._drop(node, replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything `replica_id` served."""
        if replica_id not in self._replica_chars:
            return
        for node in self._post_order():
            if replica_id in node.replicas:
                self._drop(node, replica_id)

    def _insert_path(self, text: str, replica_id: str, now: float) -> _Node:
        node, pos, end = self._root, 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                return self._add_leaf(node, text[pos:], replica_id, now)
            if not text.startswith(child.edge, pos):
                child = self._split(child, _common_prefix_len(child.edge, text, pos))
            self._touch(child, replica_id, now)
            pos += len(child.edge)
            node = child
        return node

    def _add_leaf(self, parent: _Node, edge: str, replica_id: str, now: float) -> _Node:
        leaf = _Node(edge, parent)
        parent.children[edge[0]] = leaf
        self._size += len(edge)
        self._touch(leaf, replica_id, now)
        return leaf

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` characters; return the new upper node."""
        parent = node.parent
        assert parent is not None, "the root is never split"
        upper = _Node(node.edge[:at], parent)
        upper.replicas = dict(node.replicas)
        parent.children[upper.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _touch(self, node: _Node, replica_id: str, now: float) -> None:
        seen = node.replicas.get(replica_id)
        if seen is None:
            node.replicas[replica_id] = now
            self._replica_chars[replica_id] = self.replica_chars(replica_id) + len(node.edge)
        elif now > seen:
            node.replicas[replica_id] = now

    def _drop(self, node: _Node, replica_id: str) -> None:
        """Remove one replica from one node (a leaf for it); unlink the node if now empty."""
        del node.replicas[replica_id]
        left = self._replica_chars[replica_id] - len(node.edge)
        if left:
            self._replica_chars[replica_id] = left
        else:
            del self._replica_chars[replica_id]
        if not node.replicas and node.parent is not None:
            del node.parent.children[node.edge[0]]
            self._size -= len(node.edge)

    def _evict_lru(self, protect: tuple[str, _Node]) -> None:
        order = itertools.count()
        heap: list[_HeapEntry] = []
        for node in self._post_order():
            for replica_id, seen in node.replicas.items():
                if _is_leaf_for(node, replica_id) and (replica_id, node) != protect:
                    heap.append((seen, next(order), replica_id, node))
        heapq.heapify(heap)
        while self._size > self._low_chars and heap:
            _, _, replica_id, node = heapq.heappop(heap)
            self._drop(node, replica_id)
            parent = node.parent
            if _now_leaf_for(parent, replica_id) and (replica_id, parent) != protect:
                assert parent is not None
                heapq.heappush(heap, (parent.replicas[replica_id], next(order), replica_id, parent))

    def _post_order(self) -> list[_Node]:
        """Every node below the root, each after all of its descendants."""
        nodes = list(self._pre_order())
        nodes.reverse()
        return nodes

    def _pre_order(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _is_leaf_for(node: _Node, replica_id: str) -> bool:
    return not any(replica_id in child.replicas for child in node.children.values())


def _now_leaf_for(node: _Node | None, replica_id: str) -> bool:
    """True for a non-root node that holds `replica_id` in none of its children."""
    return (
        node is not None
        and node.parent is not None
        and replica_id in node.replicas
        and _is_leaf_for(node, replica_id)
    )


def _common_prefix_len(edge: str, text: str, pos: int) -> int:
    """Length of the common prefix of `edge` and `text[pos:]`, knowing the first chars match.

    A binary search comparing slices (C memcmp); each step copies only the half still in
    doubt, so the cost is linear in the edge with a tiny constant.
    """
    low, high = 1, min(len(edge), len(text) - pos)
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(edge[low:mid], pos + low):
            low = mid
        else:
            high = mid - 1
    return low
