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
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmgw.server.router.load import LoadTracker
from llmgw.server.router.prefix_tree import DEFAULT_MAX_AGE_S, DEFAULT_MAX_CHARS, PrefixTree
from llmgw.server.router.table import Target

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


@dataclass(frozen=True, slots=True)
class Decision:
    target: Target
    tier: str  # "approximate" | "load" | "affinity" | "round_robin" ("precise": issue #6)
    outcome: str  # "hit" | "miss" | "guarded" (best match refused by the hot-replica guard)
    matched: float  # share of the request's text matched at the chosen target, 0..1


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
    max_chars: int = DEFAULT_MAX_CHARS  # per model tree
    max_age_s: float = DEFAULT_MAX_AGE_S

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_share <= 1.0 or self.load_weight < 0:
            raise ValueError("min_share must be in 0..1 and load_weight >= 0")
        if self.guard_abs < 0 or self.guard_rel < 1.0:
            raise ValueError("guard_abs must be >= 0 and guard_rel >= 1")


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
    key = f"{session}\x00{replica_id}".encode()
    return hashlib.blake2b(key, digest_size=8).digest()


@dataclass(frozen=True, slots=True)
class _Scored:
    target: Target
    share: float
    load: int
    score: float


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

    def tree(self, model: str) -> PrefixTree:
        """The model's tree (created empty on first use)."""
        tree = self._trees.get(model)
        if tree is None:
            tree = PrefixTree(max_chars=self.config.max_chars, max_age_s=self.config.max_age_s)
            self._trees[model] = tree
        return tree

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
        if not request.text:
            return self._by_load(_score(eligible, {}, 1, load, self.config), None)
        tree = self.tree(request.model)
        served = tree.match(request.text)
        scored = _score(eligible, served, len(request.text), load, self.config)
        decision = self._decide(scored, tree)
        tree.insert(request.text, decision.target.replica_id, self._clock())
        return decision

    def forget(self, replica_id: str) -> None:
        for tree in self._trees.values():
            tree.remove_replica(replica_id)

    def _decide(self, scored: list[_Scored], tree: PrefixTree) -> Decision:
        config = self.config
        ranked = sorted(scored, key=_rank)
        top = ranked[0]
        if top.share < config.min_share:
            return self._by_load(scored, tree)
        low = min(item.load for item in scored)
        allowed = [item for item in ranked if not _is_hot(item.load, low, config)]
        if allowed[0] is top:
            return Decision(top.target, TIER_APPROXIMATE, OUTCOME_HIT, top.share)
        best = allowed[0]
        tier = TIER_APPROXIMATE if best.share >= config.min_share else TIER_LOAD
        return Decision(best.target, tier, OUTCOME_GUARDED, best.share)

    @staticmethod
    def _by_load(scored: list[_Scored], tree: PrefixTree | None) -> Decision:
        def key(item: _Scored) -> tuple[int, int, str]:
            cached = tree.replica_chars(item.target.replica_id) if tree is not None else 0
            return (item.load, cached, item.target.replica_id)

        best = min(scored, key=key)
        return Decision(best.target, TIER_LOAD, OUTCOME_MISS, best.share)


def _score(
    eligible: Sequence[Target],
    served: dict[str, int],
    length: int,
    load: LoadTracker,
    config: PrefixConfig,
) -> list[_Scored]:
    loads = [load.in_flight(target.replica_id) for target in eligible]
    low = min(loads)
    scale = config.load_weight / max(1, low + config.guard_abs)
    scored = []
    for target, busy in zip(eligible, loads, strict=True):
        share = served.get(target.replica_id, 0) / length
        scored.append(_Scored(target, share, busy, share - scale * (busy - low)))
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
