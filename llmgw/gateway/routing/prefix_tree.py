"""An approximate prefix tree: which replica recently served which request text.

The gateway cannot see a replica's KV cache without KV events, so it guesses:
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

Eviction, after sglang-router's approximate tree and llm-d's per-server LRU, re-implemented
here. A node is a leaf *for a replica* when no child holds that replica, so dropping a
(replica, leaf) pair trims that replica's oldest branch tail first while shared prefixes
(touched by every request that passes through them) stay; dropping the last replica of a
node frees its characters.

- per replica (the accuracy bound): the tree must not claim more than a replica's KV
  cache holds, or the policy routes to replicas that evicted the prefix long ago. After
  an insert leaves replica r with more than its cap (`max_chars_per_replica`, or the
  override from `set_replica_limit`), r's own least recently used leaves are dropped
  until `low_watermark * cap` remain; other replicas keep theirs. Only r's nodes are
  walked: a replica present at a node is present at every ancestor, so they form a
  subtree hanging from the root.
- whole tree (the memory bound): after an insert leaves more than `max_chars` stored,
  least recently used (replica, leaf) pairs of any replica are dropped until
  `low_watermark * max_chars` remain.
- The text just inserted is never evicted by its own insert, so it always matches
  afterwards; a text longer than the replica's cap (never above `max_chars`) is stored
  truncated to it. So after every insert `size <= max_chars` and the inserting replica
  holds at most its cap; a cap lowered by `set_replica_limit` trims at once.
- age: entries not touched for `max_age_s` are dropped by a sweep that runs from `insert`
  at most every `sweep_interval_s` (default a tenth of `max_age_s`), or when called as
  `evict_expired(now)`; an entry can thus outlive `max_age_s` by up to one interval.

The age and whole-tree sweeps walk the whole tree (O(nodes)), the per-replica one that
replica's nodes; the low watermark amortises the size sweeps to a few node visits per
insert. Memory: about 1 byte per stored character for long prompts (ASCII text; edges
are str slices) plus ~500 bytes per node, i.e. one or two nodes per insert that leaves a
new branch. Times are whatever clock the caller uses (monotonic).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

# A replica's KV cache in characters of request text: llm-d's lruCapacityPerServer sizing
# (Llama-3-8B on an 80 GB H100 leaves ~64 GB for KV at 128 KiB per token: ~500 k tokens)
# at ~4 characters per token. policy.py says why, and why erring large is the lesser harm.
DEFAULT_MAX_CHARS_PER_REPLICA = 2_000_000
# The memory bound per model: eight replicas at the default cap, ~16-50 MB (see above).
DEFAULT_MAX_CHARS = 8 * DEFAULT_MAX_CHARS_PER_REPLICA
DEFAULT_MAX_AGE_S = 600.0
DEFAULT_LOW_WATERMARK = 0.9


class _Node:
    __slots__ = ("children", "edge", "parent", "replicas")

    def __init__(self, edge: str, parent: _Node | None) -> None:
        self.edge = edge
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character of the child's edge → child
        self.replicas: dict[str, float] = {}  # replica id → last time it covered this edge


_HeapEntry = tuple[float, int, str, _Node]  # (last touch, a unique order, replica, node)
_Protect = tuple[str, _Node] | None  # the (replica, node) an insert just recorded


class PrefixTree:
    """A radix tree over request texts remembering, per replica, what it served and when."""

    def __init__(
        self,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_chars_per_replica: int | None = DEFAULT_MAX_CHARS_PER_REPLICA,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        sweep_interval_s: float | None = None,
        low_watermark: float = DEFAULT_LOW_WATERMARK,
    ) -> None:
        if max_chars < 1 or max_age_s <= 0 or not 0.0 <= low_watermark <= 1.0:
            raise ValueError("max_chars >= 1, max_age_s > 0 and 0 <= low_watermark <= 1")
        self._max_chars = max_chars
        self._max_age_s = max_age_s
        self._sweep_interval_s = max_age_s / 10 if sweep_interval_s is None else sweep_interval_s
        self._low_watermark = low_watermark
        self._low_chars = int(max_chars * low_watermark)
        self._default_cap = self._cap_of(max_chars_per_replica)
        self._caps: dict[str, int] = {}  # per-replica overrides of the default cap
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

    def replica_limit(self, replica_id: str) -> int:
        """The most characters `replica_id` may hold: its override, else the default cap."""
        return self._caps.get(replica_id, self._default_cap)

    def set_replica_limit(self, replica_id: str, chars: int | None) -> None:
        """Cap what `replica_id` may hold (None: back to the default); trims it at once."""
        if chars is None:
            self._caps.pop(replica_id, None)
        else:
            self._caps[replica_id] = self._cap_of(chars)
        cap = self.replica_limit(replica_id)
        if self.replica_chars(replica_id) > cap:
            self._evict_replica(replica_id, int(cap * self._low_watermark), protect=None)

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
        cap = self._caps.get(replica_id, self._default_cap)
        text = text[:cap]
        if not text:
            return
        leaf = self._insert_path(text, replica_id, now)
        protect = (replica_id, leaf)
        if self._replica_chars[replica_id] > cap:
            self._evict_replica(replica_id, int(cap * self._low_watermark), protect)
        if self._size > self._max_chars:
            self._evict_lru(protect)

    def evict_expired(self, now: float) -> None:
        """Drop every entry not touched since `now - max_age_s`."""
        self._next_sweep = now + self._sweep_interval_s
        cutoff = now - self._max_age_s
        for node in self._post_order():
            for replica_id in [r for r, seen in node.replicas.items() if seen < cutoff]:
                self._drop(node, replica_id)

    def remove_replica(self, replica_id: str) -> None:
        """Forget everything `replica_id` served (its limit override stays)."""
        nodes = list(self._replica_nodes(replica_id))
        for node in reversed(nodes):  # children before their parents
            self._drop(node, replica_id)

    def _cap_of(self, chars: int | None) -> int:
        if chars is not None and chars < 1:
            raise ValueError(f"a replica's character limit must be >= 1, not {chars}")
        return self._max_chars if chars is None else min(chars, self._max_chars)

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

    def _evict_lru(self, protect: _Protect) -> None:
        """Drop the least recently used (replica, leaf) pairs down to the low watermark."""
        pairs = (
            (replica_id, node)
            for node in self._post_order()
            for replica_id in node.replicas
            if _is_leaf_for(node, replica_id) and (replica_id, node) != protect
        )
        heap = [(node.replicas[rid], order, rid, node) for order, (rid, node) in enumerate(pairs)]
        self._pop_lru(heap, protect, lambda: self._size <= self._low_chars)

    def _evict_replica(self, replica_id: str, down_to: int, protect: _Protect) -> None:
        """Drop `replica_id`'s least recently used leaves until it holds `down_to` chars."""
        protected = protect[1] if protect is not None and protect[0] == replica_id else None
        leaves = (node for node in self._replica_leaves(replica_id) if node is not protected)
        heap = [
            (node.replicas[replica_id], order, replica_id, node)
            for order, node in enumerate(leaves)
        ]
        self._pop_lru(heap, protect, lambda: self.replica_chars(replica_id) <= down_to)

    def _pop_lru(self, heap: list[_HeapEntry], protect: _Protect, done: Callable[[], bool]) -> None:
        """Drop pairs oldest first until `done()`; a parent left a leaf joins the heap."""
        heapq.heapify(heap)
        order = itertools.count(len(heap))
        while heap and not done():
            _, _, replica_id, node = heapq.heappop(heap)
            self._drop(node, replica_id)
            parent = node.parent
            if _now_leaf_for(parent, replica_id) and (replica_id, parent) != protect:
                assert parent is not None
                heapq.heappush(heap, (parent.replicas[replica_id], next(order), replica_id, parent))

    def _replica_leaves(self, replica_id: str) -> Iterator[_Node]:
        """The nodes holding `replica_id` in none of their children (its branch tails)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if replica_id in c.replicas]
            if below:
                stack.extend(below)
            elif node is not self._root:
                yield node

    def _replica_nodes(self, replica_id: str) -> Iterator[_Node]:
        """The nodes holding `replica_id`, each after its parent (a subtree of the root)."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node is not self._root:
                yield node
            stack.extend(c for c in node.children.values() if replica_id in c.replicas)

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
