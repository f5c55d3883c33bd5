"""The precise routing tier: the request's own KV blocks, looked up in the replicas' index.

Per request (ARCHITECTURE.md → One OpenAI request through the gateway, step 4):

1. **Tokens.** `tokenize_input` (tokenize.py) reads what the engine would tokenize; a
   replica of the model tokenizes it (``/tokenize``, the least loaded candidate, bounded by
   ``TokenizeConfig.timeout_s``); a prompt of token ids needs no call.
2. **Keys.** The tokens' llmgw block keys (``llmgw.kvcache.mirror.block_keys``: the keys the
   agents compute from the engines' events, independent of vLLM's hash algorithm and seed),
   one list per block size the candidates report (``KvIndex.block_size``, else the engine
   poller's ``cache_config_info``). Extra keys as events publish them (vLLM 0.14+, spec
   §1): a LoRA request's adapter name on every block, then ``cache_salt`` on the first
   (`extra_keys_fn`). A request is for a LoRA adapter when the table's candidates for its
   ``model`` serve another model name (they serve it as an adapter: `lora_adapter`).
   `BlockKeyCache` reuses the keys of token prefixes hashed before, so a chat that
   continues an earlier turn hashes only its new blocks.
3. **Score.** ``KvIndex.match`` counts each candidate's leading blocks; ``matched blocks ×
   block size`` over the prompt's tokens is its share, and `prefix_decision` (policy.py)
   combines share and load exactly as the approximate tier does (hot-replica guard,
   ``min_share``, ties); the decision's tier says ``precise``. A decision `Claims` its
   blocks on the chosen replica until that replica's events show them (at most
   ``claim_ttl_s``), so a burst sharing a new prefix is not prefilled on every replica
   before the first events arrive. The approximate tree records the choice too, so it
   stays warm for the requests the precise tier cannot take.

The approximate tier decides instead (`Fallback` reasons, counted in
``llmgw_precise_fallbacks_total{reason}``) when no candidate has KV events on
(``no_events``), none holds any block yet (``no_blocks``), no block size is known
(``no_block_size``), the request cannot be keyed (``multimodal``, ``prompt_embeds``,
``malformed_request``), or tokenizing failed (``timeout``, ``connect``, ``closed``,
``protocol``, ``status``, ``malformed``; ``no_tokenizer`` when built without a client).

Reuse, counted per precise decision (tokens): *available* = the best candidate's leading
cached tokens, *captured* = the chosen one's, out of the prompt's tokens; *delivered* comes
from the engines' own counters (engines.py).

Steps 2 and 3 are timed in ``llmgw_precise_seconds``; ``python -m bench.routing`` measures
them on long multi-turn chats (BENCHMARKS.md → The precise tier): hashing the new blocks,
the key cache, the index match, the claims and the scoring. ``/tokenize`` aside, the tier
pays for reading the request body again, writing the tokenize body and parsing the answer's
token ids (``json.loads``); the answer cache saves the last for repeated prompts only.
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from llmgw.gateway.metrics import GatewayMetrics
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.policy import (
    TIER_PRECISE,
    Basis,
    Decision,
    PrefixPolicy,
    RouteRequest,
    prefix_decision,
)
from llmgw.gateway.routing.table import Target
from llmgw.gateway.tokenize import TokenizeClient, TokenizeInput, tokenize_input
from llmgw.kvcache.mirror import ROOT_KEY, block_keys

log = logging.getLogger(__name__)

__all__ = [
    "GROUP_TOKENS",
    "TIER_PRECISE",
    "BlockKeyCache",
    "Claims",
    "Fallback",
    "PreciseConfig",
    "PreciseRequest",
    "PreciseTier",
    "extra_keys_fn",
    "lora_adapter",
]

GROUP_TOKENS: Final = 128
"""`BlockKeyCache` remembers keys in chunks of whole blocks covering this many tokens."""

KeysFn = Callable[..., list[int]]  # block_keys' signature (tests pass a counting wrapper)


@dataclass(frozen=True, slots=True)
class PreciseConfig:
    """The precise tier's knobs (the tokenize client has its own, ``TokenizeConfig``).

    ``claim_ttl_s`` (`Claims`): what claims are for is a burst sharing a new prefix, which
    without them is prefilled on every replica (tests/gateway/test_precise.py). A claim
    that outlives its use steers later requests to a replica for blocks it may not hold, so
    the TTL is short: long enough for the chosen replica's events to arrive, and 0.5 s did
    no harm on ``python -m bench.routing``'s workloads where 1 s cost hits and TTFT.
    """

    key_cache_groups: int = 8_192  # per block size; ~1.4 KB each: ~12 MB, 1 M tokens
    claim_ttl_s: float = 0.5  # longest a decision claims its blocks on the chosen replica
    chars_per_token: float = 4.0  # until learned from tokenized requests
    learn_rate: float = 0.02  # EWMA weight of one request's characters per token

    def __post_init__(self) -> None:
        if self.key_cache_groups < 0 or self.chars_per_token <= 0 or self.claim_ttl_s < 0:
            raise ValueError(
                "key_cache_groups and claim_ttl_s must be >= 0 and chars_per_token > 0"
            )


@dataclass(frozen=True, slots=True)
class Fallback:
    """The approximate tier decides this request; ``reason`` says why."""

    reason: str


class _Chunk:
    """A memo entry: its key (parent key, packed tokens), its blocks' keys, and the chunk
    that followed it in the latest sequence remembered (a hint for the next walk)."""

    __slots__ = ("key", "keys", "next")

    def __init__(self, key: tuple[object, bytes], keys: tuple[int, ...]) -> None:
        self.key = key
        self.keys = keys
        self.next: _Chunk | None = None


class BlockKeyCache:
    """The block keys of recent token sequences of one block size, to extend cheaply.

    A bounded LRU memo of *chunks*: (parent key, the packed tokens of up to ``GROUP_TOKENS
    // block size`` whole blocks, aligned from the first) → those blocks' keys. `keys` walks
    the request's tokens a chunk at a time while the memo knows them: first the chunk that
    followed the previous one last time (``bytes.startswith``, a memcmp), else a dict
    lookup; then the shorter chunk an earlier sequence ended with; it hashes the rest with
    ``block_keys(parent=..., first_block=...)`` and remembers the new chunks. The result
    always equals ``block_keys(tokens, block_size, extra_keys_fn=extra_keys_fn(lora, salt))``.
    """

    def __init__(
        self, block_size: int, *, max_groups: int = 8_192, hasher: KeysFn = block_keys
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hashed = 0  # blocks hashed so far (the rest came from the memo)
        self._per = max(1, GROUP_TOKENS // block_size)  # blocks per chunk
        self._max = max_groups
        self._hasher = hasher
        self._memo: OrderedDict[tuple[object, bytes], _Chunk] = OrderedDict()

    def __len__(self) -> int:
        return len(self._memo)

    def keys(
        self, tokens: array[int], salt: str | None = None, lora: str | None = None
    ) -> list[int]:
        """The keys of the full blocks of ``tokens`` (best as ``array('Q')``: ``block_keys``
        packs such an array with a memcpy, any other with a loop) for a request with this
        cache salt and LoRA adapter name."""
        if tokens.typecode != "Q":
            tokens = array("Q", tokens)
        packed = tokens.tobytes()
        step = self.block_size * tokens.itemsize
        total = len(tokens) // self.block_size
        root: object = ROOT_KEY if salt is None and lora is None else ("extra", lora, salt)
        out, anchor = self._walk(packed, step, total, root)
        known = len(out)
        if known < total:
            parent = out[-1] if out else ROOT_KEY
            extra = extra_keys_fn(lora, salt)
            fresh = self._hasher(
                tokens, self.block_size, extra_keys_fn=extra, parent=parent, first_block=known
            )
            self.hashed += len(fresh)
            out += fresh
            self._remember(packed, step, out, known, root, anchor)
        return out

    def _walk(
        self, packed: bytes, step: int, total: int, root: object
    ) -> tuple[list[int], _Chunk | None]:
        """The keys the memo knows for the leading blocks, and the last whole chunk met."""
        memo, per = self._memo, self._per
        out: list[int] = []
        parent, last = root, None
        while len(out) < total:
            start = len(out) * step
            chunk = last.next if last is not None else None
            if chunk is None or not packed.startswith(chunk.key[1], start) or chunk.key not in memo:
                chunk = None
                if len(out) + per <= total:
                    chunk = memo.get((parent, packed[start : start + per * step]))
                if chunk is None:
                    break
            memo.move_to_end(chunk.key)
            out += chunk.keys
            if len(chunk.keys) < per:
                return out, last  # a sequence ended here: nothing follows in the memo
            parent, last = chunk.keys[-1], chunk
        start = len(out) * step
        for blocks in range(min(total - len(out), per - 1), 0, -1):  # where one ended
            chunk = memo.get((parent, packed[start : start + blocks * step]))
            if chunk is not None:
                memo.move_to_end(chunk.key)
                out += chunk.keys
                break
        return out, last

    def _remember(
        self,
        packed: bytes,
        step: int,
        keys: list[int],
        known: int,
        root: object,
        anchor: _Chunk | None,
    ) -> None:
        if not self._max:
            return
        memo, per = self._memo, self._per
        for first in range(known // per * per, len(keys), per):
            last = min(first + per, len(keys))
            parent = keys[first - 1] if first else root
            key = (parent, packed[first * step : last * step])
            chunk = memo.get(key)
            if chunk is None:
                chunk = memo[key] = _Chunk(key, tuple(keys[first:last]))
            if anchor is not None:
                anchor.next = chunk
            anchor = chunk
        while len(memo) > self._max:
            memo.popitem(last=False)[1].next = None  # no chains of evicted chunks


class Claims:
    """Blocks just sent to a replica that its KV events cannot show yet.

    vLLM publishes a prompt's blocks when the step that computed them ends, so for the
    prefill time (and the feed's lag) the index does not know that the replica the last
    request went to will hold its prefix; a second request with the same prefix would be
    sent elsewhere and prefilled twice. A decision therefore *claims*, for ``ttl_s``, the
    blocks the index does not show on the chosen replica yet. A key names its whole prefix,
    so a claim keeps only the keys of every ``stride``-th block and of the last one: a
    claimed key at block i says blocks 0..i (``held`` is exact to ``stride`` blocks). A
    claim never lowers what the index says; once its ``ttl_s`` is over, the index alone
    speaks.
    """

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._by_key: dict[int, dict[str, float]] = {}  # key → replica → claimed until
        self._expiry: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._by_key)

    def claim(
        self, keys: Sequence[int], replica_id: str, now: float, stride: int, known: int = 0
    ) -> None:
        """``replica_id`` was sent a request of these block keys at ``now``; the index shows
        it holding the first ``known`` of them already."""
        self._expire(now)
        if self.ttl_s <= 0:
            return
        until = now + self.ttl_s
        by_key, expiry = self._by_key, self._expiry
        for position in _positions(len(keys), stride, known):
            key = keys[position]
            holders = by_key.get(key)
            if holders is None:
                holders = by_key[key] = {}
            holders[replica_id] = until
            expiry.append((until, key, replica_id))

    def held(
        self, keys: Sequence[int], replica_ids: Collection[str], now: float, stride: int
    ) -> dict[str, int]:
        """Per replica of ``replica_ids`` with a live claim on ``keys``' leading blocks, how
        many blocks it claims."""
        out: dict[str, int] = {}
        if not self._by_key:
            return out
        by_key = self._by_key
        for position in _positions(len(keys), stride):
            holders = by_key.get(keys[position])
            if holders:
                for replica_id, until in holders.items():
                    if until > now and replica_id in replica_ids:
                        out[replica_id] = position + 1
        return out

    def _expire(self, now: float) -> None:
        expiry, by_key = self._expiry, self._by_key
        while expiry and expiry[0][0] <= now:
            until, key, replica_id = expiry.popleft()
            holders = by_key.get(key)
            if holders is not None and holders.get(replica_id) == until:
                del holders[replica_id]
                if not holders:
                    del by_key[key]


def _positions(count: int, stride: int, start: int = 0) -> range | list[int]:
    """Every ``stride``-th block and the last one, of ``count`` blocks, from ``start`` on."""
    first = max(stride - 1, start + (stride - 1 - start) % stride)
    positions = range(first, count, stride)
    if count > start and (not positions or positions[-1] != count - 1):
        return [*positions, count - 1]
    return positions


def _stride(block_size: int) -> int:
    """Claims keep a key per this many blocks: about ``GROUP_TOKENS`` tokens."""
    return max(1, GROUP_TOKENS // block_size)


def extra_keys_fn(
    lora: str | None, salt: str | None
) -> Callable[[int, int], tuple[object, ...] | None] | None:
    """Block extra keys of a request as vLLM 0.14+ events publish them (what the agents'
    mirrors key blocks with): the LoRA adapter's name on every block, then the cache salt
    on block 0 (``extra_keys`` from 0.17, untagged from 0.31; before 0.17 the mirror takes
    ``(lora_name,)``). None for a plain request."""
    if lora is None and salt is None:
        return None
    first = tuple(key for key in (lora, salt) if key is not None)
    later = None if lora is None else (lora,)

    def extra(start: int, end: int) -> tuple[object, ...] | None:
        return first if start == 0 else later

    return extra


def lora_adapter(model: str, candidates: Sequence[Target]) -> str | None:
    """The LoRA adapter a request for ``model`` runs on, or None for a base model.

    The routing table gives a request the replicas serving its ``model``, under their
    served model name or as one of their LoRA adapters; candidates whose served name is
    not ``model`` serve it as an adapter. (When some serve it under that name, it is a
    base model: their keys stay plain.)
    """
    if not candidates or any(target.model == model for target in candidates):
        return None
    return model


@dataclass(slots=True)
class PreciseRequest:
    """One request's tokens and, per block size, its keys (computed once, on demand)."""

    tokens: array[int]
    salt: str | None = None
    lora: str | None = None  # the LoRA adapter's name (`lora_adapter`)
    keys_by_size: dict[int, list[int]] = field(default_factory=dict)
    timed: bool = False  # the first decision's cost has been recorded


class PreciseTier:
    """Tokens → keys → index match → `prefix_decision`, with the approximate tree kept warm.

    ``block_size_of(replica_id)`` says a replica's tokens per block when the index does not
    (0 = unknown): the gateway passes the engine poller's. ``clock`` stamps tree inserts.
    """

    def __init__(  # noqa: PLR0913 (collaborators the gateway passes and tests replace)
        self,
        index: KvIndex,
        policy: PrefixPolicy,
        tokenizer: TokenizeClient | None,
        config: PreciseConfig = PreciseConfig(),
        *,
        metrics: GatewayMetrics | None = None,
        block_size_of: Callable[[str], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        hasher: KeysFn = block_keys,
    ) -> None:
        self.index = index
        self.policy = policy
        self.config = config
        self.chars_per_token = config.chars_per_token
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._block_size_of = block_size_of
        self._clock = clock
        self._hasher = hasher
        self._caches: dict[int, BlockKeyCache] = {}
        self._turn = itertools.count()
        self.claims = Claims(config.claim_ttl_s)

    # -- sizes and keys ---------------------------------------------------------------------

    def block_size(self, replica_id: str) -> int:
        """``replica_id``'s tokens per block (0 = unknown): the index's, else the poller's."""
        size = self.index.block_size(replica_id)
        if not size and self._block_size_of is not None:
            size = self._block_size_of(replica_id)
        return size

    def cache(self, block_size: int) -> BlockKeyCache:
        cache = self._caches.get(block_size)
        if cache is None:
            cache = self._caches[block_size] = BlockKeyCache(
                block_size, max_groups=self.config.key_cache_groups, hasher=self._hasher
            )
        return cache

    def keys(self, request: PreciseRequest, block_size: int) -> list[int]:
        keys = request.keys_by_size.get(block_size)
        if keys is None:
            keys = request.keys_by_size[block_size] = self.cache(block_size).keys(
                request.tokens, request.salt, request.lora
            )
        return keys

    # -- before deciding: tokens ------------------------------------------------------------

    def applicable(self, candidates: Sequence[Target]) -> str:
        """Why the precise tier cannot decide among ``candidates`` ("" when it can)."""
        published = [t for t in candidates if t.kv_events]
        if not published:
            return "no_events"
        holding = [t for t in published if self.index.blocks_of(t.replica_id)]
        if not holding:
            return "no_blocks"
        if not any(self.block_size(t.replica_id) for t in holding):
            return "no_block_size"
        return ""

    async def prepare(
        self,
        path: str,
        body: bytes,
        model: str,
        text_len: int,
        candidates: Sequence[Target],
        load: LoadTracker,
    ) -> PreciseRequest | Fallback:
        """The request's tokens, or why the approximate tier must decide it (counted)."""
        reason = self.applicable(candidates)
        if reason:
            return self._fallback(reason)
        wanted = tokenize_input(path, body, model)
        if wanted.unsupported:
            return self._fallback(wanted.unsupported)
        lora = lora_adapter(model, candidates)
        if wanted.tokens is not None:
            return PreciseRequest(wanted.tokens, wanted.cache_salt, lora)
        tokens = await self._tokenize(wanted, candidates, load)
        if isinstance(tokens, Fallback):
            return tokens
        self._learn(text_len, len(tokens))
        return PreciseRequest(tokens, wanted.cache_salt, lora)

    async def _tokenize(
        self, wanted: TokenizeInput, candidates: Sequence[Target], load: LoadTracker
    ) -> array[int] | Fallback:
        if self._tokenizer is None:
            return self._fallback("no_tokenizer")
        target = self._tokenizing_replica(candidates, load)
        result = await self._tokenizer.tokenize(target.url, target.api_key, wanted.body)
        if self._metrics is not None and not result.cached:
            self._metrics.tokenized(result.seconds, result.failure)
        if result.tokens is None:
            log.debug("tokenize on %s: %s; approximate tier", target.replica_id, result.failure)
            return self._fallback(result.failure)
        return result.tokens

    def _tokenizing_replica(self, candidates: Sequence[Target], load: LoadTracker) -> Target:
        """The least loaded candidate; ties rotate so idle replicas share the work."""
        start = next(self._turn) % len(candidates)
        rotated = [*candidates[start:], *candidates[:start]]
        return min(rotated, key=lambda t: load.in_flight(t.replica_id))

    def _learn(self, text_len: int, num_tokens: int) -> None:
        if text_len > 0 and num_tokens > 0:
            rate = self.config.learn_rate
            self.chars_per_token += rate * (text_len / num_tokens - self.chars_per_token)

    def _fallback(self, reason: str) -> Fallback:
        if self._metrics is not None:
            self._metrics.precise_fallback(reason)
        return Fallback(reason)

    # -- deciding ---------------------------------------------------------------------------

    def choose(
        self,
        request: PreciseRequest,
        route: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None:
        """The precise decision among ``candidates`` not in ``exclude`` (None: none left);
        the approximate tree records it."""
        eligible = [t for t in candidates if t.replica_id not in exclude]
        if not eligible:
            return None
        started = time.perf_counter()
        now = self._clock()
        matched, sizes = self.matched_tokens(request, eligible)
        likely = self._with_claims(request, matched, sizes, now)
        loads = {t.replica_id: load.in_flight(t.replica_id) for t in eligible}
        total = max(1, len(request.tokens))

        def cached(replica_id: str) -> int:
            return self.index.blocks_of(replica_id) * sizes.get(replica_id, 0)

        decision = prefix_decision(
            eligible, likely, loads, self.policy.config, total=total, cached=cached
        )
        chosen = decision.target.replica_id
        basis = Basis(eligible, matched, loads, total, sizes, likely)
        decision = Decision(
            decision.target, TIER_PRECISE, decision.outcome, decision.matched, basis
        )
        size = sizes.get(chosen, 0)
        if size:
            known = matched.get(chosen, 0) // size
            self.claims.claim(self.keys(request, size), chosen, now, _stride(size), known)
        self._account(request, matched, chosen, started)
        if route.text:
            tree = self.policy.tree(route.model)
            tree.insert(route.text, decision.target.replica_id, self._clock())
        return decision

    def matched_tokens(
        self, request: PreciseRequest, candidates: Sequence[Target]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Per candidate, the request's leading tokens it holds (whole blocks), and each
        candidate's block size. A candidate with KV events whose size is not known yet (a
        new replica that has published nothing) is taken to share the most common size of
        the others: it holds nothing, but its decisions can be claimed."""
        sizes = self.candidate_sizes(candidates)
        by_size: dict[int, list[str]] = {}
        for replica_id, size in sizes.items():
            by_size.setdefault(size, []).append(replica_id)
        matched: dict[str, int] = {}
        for size, replica_ids in by_size.items():
            held = self.index.match(self.keys(request, size), replica_ids)
            for replica_id, blocks in held.items():
                matched[replica_id] = blocks * size
        return matched, sizes

    def candidate_sizes(self, candidates: Sequence[Target]) -> dict[str, int]:
        """The block size of each candidate with KV events (see `matched_tokens`)."""
        sizes: dict[str, int] = {}
        unknown: list[str] = []
        for target in candidates:
            if target.kv_events:
                size = self.block_size(target.replica_id)
                if size:
                    sizes[target.replica_id] = size
                else:
                    unknown.append(target.replica_id)
        if unknown and sizes:
            common = Counter(sizes.values()).most_common(1)[0][0]
            sizes.update(dict.fromkeys(unknown, common))
        return sizes

    def _with_claims(
        self, request: PreciseRequest, matched: dict[str, int], sizes: dict[str, int], now: float
    ) -> dict[str, int]:
        """``matched`` raised where a live claim says a replica will hold more."""
        if not len(self.claims):
            return matched
        likely = dict(matched)
        by_size: dict[int, set[str]] = {}
        for replica_id, size in sizes.items():
            by_size.setdefault(size, set()).add(replica_id)
        for size, replica_ids in by_size.items():
            keys = self.keys(request, size)
            for replica_id, blocks in self.claims.held(
                keys, replica_ids, now, _stride(size)
            ).items():
                likely[replica_id] = max(likely.get(replica_id, 0), blocks * size)
        return likely

    def _account(
        self, request: PreciseRequest, matched: Mapping[str, int], chosen: str, started: float
    ) -> None:
        if self._metrics is None or request.timed:
            return
        request.timed = True  # a retry's decision is not counted twice
        available = max(matched.values(), default=0)
        self._metrics.precise_decided(
            len(request.tokens), available, matched.get(chosen, 0), time.perf_counter() - started
        )
