"""Routing policies: which READY replica of a model serves the next request.

Every policy is a plain object without I/O. The gateway calls `choose(request,
candidates, load, exclude=...)` once per attempt, then acquires the chosen replica on the
`LoadTracker` before anything else happens, and releases it when the upstream request
ends. `choose` itself never touches the tracker, but it reads it, so a burst of choices
separated by acquires spreads. A retry passes the replicas that already failed in
`exclude`; `None` means nothing is left. `choose` records its choice (tree insert,
round-robin cursor, session pin) because that replica is the one that will hold the
request's KV blocks. `forget(replica_id)` drops a replica that left the table.

Policies (`POLICIES`, `make_policy`):

- `round_robin`: cycles through the candidates per model (tier "round_robin").
- `least_load`: fewest requests in flight; ties rotate so sequential traffic spreads too
  (tier "load").
- `session`: a request with a session key goes to the replica pinned for that key (tier
  "affinity", outcome "hit"); an unknown key, or one whose replica left or is excluded, is
  placed by rendezvous hashing (highest blake2b(session, replica) wins: every gateway
  agrees and only the sessions of a departed replica move) and pinned (outcome "miss").
  Pins live in a bounded LRU map. Without a session key: least load.
- `prefix` (the default): the approximate prefix tree (prefix_tree.py), described below.

Scoring of the prefix policy, per candidate r with `share_r` = characters of the request
text that r served recently / length of the text, `load_r` its requests in flight and
`low` the smallest load among the candidates:

    score_r = share_r - load_weight * (load_r - low) / (low + guard_abs)

so a replica holding more of the prefix wins unless it is markedly busier: with the
defaults, 4 more requests in flight than the least loaded idle replica cost 0.25 of
share. Ties go to less load, then to the smaller replica id.

The guard (per request, never a fleet-wide mode): a candidate is *hot* when

    load_r - low > guard_abs  and  load_r > guard_rel * low      (defaults 4 and 2.0)

i.e. more than 4 requests and more than twice the least loaded one's in flight. A hot
replica is refused for this request only; the best of the others is taken and the
decision says outcome "guarded" if the refused one would have won. The next request is
scored afresh, so the hot replica gets traffic again as soon as its load falls back.

A best share below `min_share` (default 0.1: a greeting in common is no reason to queue)
is a miss: the request goes by load (least in flight, then the replica with the fewest
characters in the tree, so new prefixes spread over the fleet's caches, then id) with
tier "load" and outcome "miss". Either way the tree records the choice, so the next
request sharing the prefix hits. Requests without text route by load and are not recorded.
`prefix_decision` is this scoring on plain values; the policy feeds it the tree's matches.

What the tree may claim per replica (`max_chars_per_replica`, prefix_tree.py) should be
what the replica's KV cache holds, in characters: its KV tokens × the traffic's characters
per token. ``python -m bench.routing`` tries both ways of getting it wrong (BENCHMARKS.md →
Routing policies): sized larger than the KV, the tree claims more cached than the chosen
engines hold; sized smaller, it forgets prefixes the engines still hold, misses, and
spreads them over engines that must prefill them again, which loses more. Too small is the
worse error, so the default errs large: 2 M characters, llm-d's per-server
sizing (~500 k tokens: an 8 B model on an 80 GB H100) at ~4 characters per token.
`PrefixConfig(max_chars_per_replica=...)` sets it per gateway, and
`PrefixPolicy.set_replica_capacity(replica_id, chars)` per replica once the engine's KV
capacity is known (vLLM reports num_gpu_blocks × block_size tokens).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple, Protocol

from llmgw.gateway.routing.load import LoadTracker
from llmgw.gateway.routing.prefix_tree import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_CHARS_PER_REPLICA,
    PrefixTree,
)
from llmgw.gateway.routing.table import Target

TIER_PRECISE = "precise"  # decided on the KV index (llmgw.gateway.precise)
TIER_APPROXIMATE = "approximate"
TIER_LOAD = "load"
TIER_AFFINITY = "affinity"
TIER_ROUND_ROBIN = "round_robin"
OUTCOME_HIT = "hit"
OUTCOME_MISS = "miss"
OUTCOME_GUARDED = "guarded"

POLICIES: tuple[str, ...] = ("prefix", "round_robin", "least_load", "session")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    text: str = ""  # the prompt, or the rendered messages (openai.render_messages)
    session: str = ""  # affinity key: header "x-session-id" else body "user"; "" = none


class Basis(NamedTuple):
    """What a prefix decision weighed, kept by reference (nothing copied) so that the
    decision can be explained later (explain.py): per candidate, what it holds of the
    request (``matched``: characters of the text, or tokens for the precise tier) and its
    requests in flight, out of ``total`` (the text's length or the prompt's tokens).
    ``block_sizes`` gives each candidate's tokens per block for the precise tier (empty:
    ``matched`` counts characters); ``claimed``, what the precise tier scored: ``matched``
    raised by its live claims (None: ``matched`` itself)."""

    candidates: Sequence[Target]
    matched: Mapping[str, float]
    loads: Mapping[str, int]
    total: float
    block_sizes: Mapping[str, int] = MappingProxyType({})
    claimed: Mapping[str, float] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    target: Target
    tier: str  # "approximate" | "load" | "affinity" | "round_robin" ("precise": precise.py)
    outcome: str  # "hit" | "miss" | "guarded" (best match refused by the hot-replica guard)
    matched: float  # share of the request's text matched at the chosen target, 0..1
    # what the prefix scoring weighed, for explaining (None: other policies); not compared
    basis: Basis | None = field(default=None, compare=False, repr=False)


class Policy(Protocol):
    name: str

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None: ...

    def forget(self, replica_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixConfig:
    """Knobs of the prefix policy; the module docstring explains each."""

    min_share: float = 0.1
    load_weight: float = 0.25
    guard_abs: int = 4
    guard_rel: float = 2.0
    max_chars: int = DEFAULT_MAX_CHARS  # per model tree: the memory bound
    max_chars_per_replica: int | None = DEFAULT_MAX_CHARS_PER_REPLICA  # the accuracy bound
    max_age_s: float = DEFAULT_MAX_AGE_S

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share <= 1.0 or self.load_weight < 0:
            raise ValueError("min_share must be in 0..1 and load_weight >= 0")
        if self.guard_abs < 0 or self.guard_rel < 1.0:
            raise ValueError("guard_abs must be >= 0 and guard_rel >= 1")
        per_replica = self.max_chars_per_replica
        if self.max_chars < 1 or (per_replica is not None and per_replica < 1):
            raise ValueError("max_chars and max_chars_per_replica must be >= 1")


def _eligible(candidates: Sequence[Target], exclude: frozenset[str]) -> Sequence[Target]:
    if not exclude:
        return candidates
    return [target for target in candidates if target.replica_id not in exclude]


class RoundRobinPolicy:
    """Each model's candidates in turn."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor: dict[str, int] = {}

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None:
        eligible = _eligible(candidates, exclude)
        if not eligible:
            return None
        turn = self._cursor.get(request.model, 0)
        self._cursor[request.model] = turn + 1
        return Decision(eligible[turn % len(eligible)], TIER_ROUND_ROBIN, OUTCOME_MISS, 0.0)

    def forget(self, replica_id: str) -> None:
        """Nothing kept per replica."""


class LeastLoadPolicy:
    """Fewest requests in flight; ties rotate so that idle traffic spreads as well."""

    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None:
        eligible = _eligible(candidates, exclude)
        if not eligible:
            return None
        start = next(self._turn) % len(eligible)
        rotated = [*eligible[start:], *eligible[:start]]
        best = min(rotated, key=lambda target: load.in_flight(target.replica_id))
        return Decision(best, TIER_LOAD, OUTCOME_MISS, 0.0)

    def forget(self, replica_id: str) -> None:
        """Nothing kept per replica."""


class SessionPolicy:
    """Session affinity through a bounded map, with rendezvous hashing for new sessions."""

    name = "session"

    def __init__(self, max_sessions: int = 100_000) -> None:
        self._max_sessions = max_sessions
        self._pins: OrderedDict[str, str] = OrderedDict()  # session → replica id
        self._fallback = LeastLoadPolicy()

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None:
        if not request.session:
            return self._fallback.choose(request, candidates, load, exclude=exclude)
        eligible = _eligible(candidates, exclude)
        if not eligible:
            return None
        pinned = self._pins.get(request.session)
        for target in eligible:
            if target.replica_id == pinned:
                self._pins.move_to_end(request.session)
                return Decision(target, TIER_AFFINITY, OUTCOME_HIT, 0.0)
        target = max(eligible, key=lambda t: _rendezvous(request.session, t.replica_id))
        self._pin(request.session, target.replica_id)
        return Decision(target, TIER_AFFINITY, OUTCOME_MISS, 0.0)

    def forget(self, replica_id: str) -> None:
        gone = [session for session, pinned in self._pins.items() if pinned == replica_id]
        for session in gone:
            del self._pins[session]

    def _pin(self, session: str, replica_id: str) -> None:
        self._pins[session] = replica_id
        self._pins.move_to_end(session)
        while len(self._pins) > self._max_sessions:
            self._pins.popitem(last=False)


def _rendezvous(session: str, replica_id: str) -> bytes:
    # surrogatepass: a JSON body's "user" may hold a lone surrogate ("\ud800" is valid JSON)
    key = f"{session}\x00{replica_id}".encode("utf-8", "surrogatepass")
    return hashlib.blake2b(key, digest_size=8).digest()


class PrefixPolicy:
    """Prefix match against load, with a per-request hot-replica guard (module docstring)."""

    name = "prefix"

    def __init__(
        self,
        config: PrefixConfig = PrefixConfig(),
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._trees: dict[str, PrefixTree] = {}
        self._capacities: dict[str, int] = {}  # replica id → chars its KV cache holds

    def tree(self, model: str) -> PrefixTree:
        """The model's tree (created empty on first use)."""
        tree = self._trees.get(model)
        if tree is None:
            tree = PrefixTree(
                max_chars=self.config.max_chars,
                max_chars_per_replica=self.config.max_chars_per_replica,
                max_age_s=self.config.max_age_s,
            )
            for replica_id, chars in self._capacities.items():
                tree.set_replica_limit(replica_id, chars)
            self._trees[model] = tree
        return tree

    def set_replica_capacity(self, replica_id: str, chars: int | None) -> None:
        """What `replica_id`'s KV cache holds, in characters of request text (None: unknown).

        The tree then remembers at most that much for the replica instead of
        `max_chars_per_replica`: KV tokens × characters per token of the traffic (about 4
        for English text). Kept across `forget` (a fact about the replica's engine, not
        about what it served); None drops it.
        """
        if chars is None:
            self._capacities.pop(replica_id, None)
        else:
            self._capacities[replica_id] = chars
        for tree in self._trees.values():
            tree.set_replica_limit(replica_id, chars)

    def choose(
        self,
        request: RouteRequest,
        candidates: Sequence[Target],
        load: LoadTracker,
        *,
        exclude: frozenset[str] = frozenset(),
    ) -> Decision | None:
        eligible = _eligible(candidates, exclude)
        if not eligible:
            return None
        loads = {target.replica_id: load.in_flight(target.replica_id) for target in eligible}
        if not request.text:
            return _by_load(_score(eligible, {}, 1.0, loads, self.config), None)
        tree = self.tree(request.model)
        served = tree.match(request.text)
        total = len(request.text)
        decision = prefix_decision(
            eligible, served, loads, self.config, total=total, cached=tree.replica_chars
        )
        tree.insert(request.text, decision.target.replica_id, self._clock())
        basis = Basis(eligible, served, loads, total)
        return Decision(decision.target, decision.tier, decision.outcome, decision.matched, basis)

    def forget(self, replica_id: str) -> None:
        for tree in self._trees.values():
            tree.remove_replica(replica_id)


class _Scored(NamedTuple):  # a tuple: built per candidate per request, cheaply
    target: Target
    share: float
    load: int
    score: float


def prefix_decision(
    candidates: Sequence[Target],
    matched: Mapping[str, float],
    loads: Mapping[str, int],
    config: PrefixConfig = PrefixConfig(),
    *,
    total: float = 1.0,
    cached: Callable[[str], int] | None = None,
) -> Decision:
    """The prefix policy's choice among `candidates`, from plain values (no tree, no I/O).

    Per replica id (absent = 0): `matched[r] / total` is the share of the request that r
    holds (characters of the text and its length, tokens and the prompt's length, or
    shares and 1.0); `loads[r]` its requests in flight; `cached(r)` how much it holds
    overall, in any one unit: the tie-break that spreads new prefixes on a miss, a
    function because only a miss reads it. The scoring, the guard and the tie-breaks are
    the module docstring's. `PrefixPolicy` decides through this function, and so can
    anything that learns the shares another way (exact KV caches, a precise index).
    ValueError when `candidates` is empty.
    """
    if not candidates:
        raise ValueError("no candidate to choose from")
    scored = _score(candidates, matched, total, loads, config)
    ranked = sorted(scored, key=_rank)
    top = ranked[0]
    if top.share < config.min_share:
        return _by_load(scored, cached)
    low = min(item.load for item in scored)
    allowed = [item for item in ranked if not _is_hot(item.load, low, config)]
    if allowed[0] is top:
        return Decision(top.target, TIER_APPROXIMATE, OUTCOME_HIT, top.share)
    best = allowed[0]
    tier = TIER_APPROXIMATE if best.share >= config.min_share else TIER_LOAD
    return Decision(best.target, tier, OUTCOME_GUARDED, best.share)


def _by_load(scored: list[_Scored], cached: Callable[[str], int] | None) -> Decision:
    """Least in flight, then the replica holding least (new prefixes spread), then id."""

    def key(item: _Scored) -> tuple[int, int, str]:
        replica_id = item.target.replica_id
        return (item.load, cached(replica_id) if cached else 0, replica_id)

    best = min(scored, key=key)
    return Decision(best.target, TIER_LOAD, OUTCOME_MISS, best.share)


def _score(
    candidates: Sequence[Target],
    matched: Mapping[str, float],
    total: float,
    loads: Mapping[str, int],
    config: PrefixConfig,
) -> list[_Scored]:
    if total <= 0:
        raise ValueError(f"total must be > 0, not {total}")
    busy = [loads.get(target.replica_id, 0) for target in candidates]
    low = min(busy)
    scale = config.load_weight / max(1, low + config.guard_abs)
    scored = []
    for target, in_flight in zip(candidates, busy, strict=True):
        share = min(1.0, matched.get(target.replica_id, 0) / total)
        scored.append(_Scored(target, share, in_flight, share - scale * (in_flight - low)))
    return scored


def _rank(item: _Scored) -> tuple[float, int, str]:
    return (-item.score, item.load, item.target.replica_id)


def _is_hot(busy: int, low: int, config: PrefixConfig) -> bool:
    """The guard: far busier than the least loaded candidate, absolutely and relatively."""
    return busy - low > config.guard_abs and busy > config.guard_rel * low


_FACTORIES: dict[str, Callable[[], Policy]] = {
    "prefix": PrefixPolicy,
    "round_robin": RoundRobinPolicy,
    "least_load": LeastLoadPolicy,
    "session": SessionPolicy,
}


def make_policy(name: str) -> Policy:
    """A fresh policy by name; ValueError naming the choices for an unknown one."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory()
