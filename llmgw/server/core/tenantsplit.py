"""A tenant key's limits split between the gateways of the fleet (issue #18).

Each gateway enforces its part of a key's requests-per-minute, tokens-per-minute and
concurrency (``KeyAllowance``, answered in the ack of its ``RouterReport``) on its own
sliding minute. The parts are computed so that together they never exceed the key's
limit at the moment they are computed:

    allowance_g = used_g + part_g of the room left, R = max(0, limit − Σ used)

where ``used_g`` is what gateway g's window holds now (``KeyWindow``) and the room is shared
by weight w_g = (1 − reserve) × g's share of the key's recent demand + reserve × an equal
share (all equal when there is no demand), in whole units by largest remainder
(:func:`split_budget`). A gateway that already used a lot keeps what it used (its window
holds it) and gets its share of what is left; one with no traffic still gets ``reserve``
of the room, so a client moving to it is not refused until the next rebalance.

Demand is what each gateway was asked (admitted or refused by a limit: ``asked_requests``,
``asked_tokens``, cumulative) over its last report interval. A gateway whose report is
older than three of its intervals is no longer given a part, but what it admitted is
counted as used for a minute after its last report (its requests are still in the fleet's
minute). Gateways are answered one at a time, each from the latest windows of all, and
between two of its reports a gateway may use the part it was given; so a gateway's new part
is at most what the others' parts, as given, leave (and at least what it already used):
the parts never sum over the limit, and a part moves toward its share as each gateway
reports. What a gateway admits before its first answer (the whole limit) is the exception;
bench/tenants.py measures the overshoot. A gateway cut off keeps enforcing its last part,
which is counted here for a minute after its last report only.

Pure: no I/O, an injectable clock; memory bounded by ``max_gateways`` × the keys with limits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmgw.api.llmgw.v1 import KeyAllowance, KeyWindow


class LimitedKey(Protocol):
    """What the split reads of a key (``TenantKey`` and the store's record both have it)."""

    @property
    def key_id(self) -> str: ...
    @property
    def rpm(self) -> int: ...
    @property
    def tpm(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...


DEFAULT_RESERVE = 0.2
"""The share of a key's room split equally between live gateways, whatever their demand."""
STALE_INTERVALS = 3
USED_KEPT_S = 60.0
"""How long a silent gateway's last window counts as used (the limits' window)."""
DEFAULT_MAX_GATEWAYS = 256


def split_budget(
    limit: int, used: Sequence[int], demand: Sequence[float], reserve: float = DEFAULT_RESERVE
) -> list[int]:
    """Each gateway's allowance: its ``used`` plus its part of the room left (module
    docstring). The allowances sum to at most ``limit`` (exactly ``limit`` when the used
    ones do not already exceed it)."""
    if len(used) != len(demand):
        raise ValueError("used and demand name the same gateways")
    n = len(used)
    if n == 0:
        return []
    room = max(0, limit - sum(used))
    asked = sum(demand)
    weights = [(1 - reserve) * (d / asked if asked > 0 else 1 / n) + reserve / n for d in demand]
    exact = [room * w for w in weights]
    parts = [int(x) for x in exact]
    left = room - sum(parts)
    by_remainder = sorted(range(n), key=lambda i: exact[i] - parts[i], reverse=True)
    for i in by_remainder[:left]:
        parts[i] += 1
    return [u + p for u, p in zip(used, parts, strict=True)]


@dataclass(slots=True)
class _Gateway:
    reported_at: float
    interval_s: float
    windows: dict[str, KeyWindow] = field(default_factory=dict)
    # the asked_* counters of the report before, to take the demand as a difference
    previous: dict[str, tuple[int, int]] = field(default_factory=dict)
    demand: dict[str, tuple[float, float]] = field(default_factory=dict)  # per second
    allowances: dict[str, KeyAllowance] = field(default_factory=dict)  # as last given


class FleetSplit:
    """The latest windows of every gateway, and each one's allowances (module docstring)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        reserve: float = DEFAULT_RESERVE,
        max_gateways: int = DEFAULT_MAX_GATEWAYS,
    ) -> None:
        self.clock = clock
        self.reserve = reserve
        self.max_gateways = max_gateways
        self._gateways: dict[str, _Gateway] = {}

    def take(
        self,
        gateway_id: str,
        windows: Iterable[KeyWindow],
        interval_s: float,
        keys: Iterable[LimitedKey],
    ) -> list[KeyAllowance]:
        """Keep ``gateway_id``'s windows; its allowance for every key of ``keys`` with a limit."""
        now = self.clock()
        self._forget_silent(now)
        gateway = self._gateways.get(gateway_id)
        if gateway is None:
            self._make_room()
            gateway = self._gateways[gateway_id] = _Gateway(now, interval_s)
        elapsed = max(now - gateway.reported_at, 1e-3)
        gateway.reported_at, gateway.interval_s = now, max(interval_s, 0.1)
        limited = [key for key in keys if _limited(key)]
        known = {key.key_id for key in limited}  # a window of any other key is dropped
        gateway.windows = {w.key_id: w for w in windows if w.key_id in known}
        demand: dict[str, tuple[float, float]] = {}
        previous: dict[str, tuple[int, int]] = {}
        for key_id, w in gateway.windows.items():
            before = gateway.previous.get(key_id)
            asked = (w.asked_requests, w.asked_tokens)
            previous[key_id] = asked
            if before is not None and asked[0] >= before[0] and asked[1] >= before[1]:
                demand[key_id] = (
                    (asked[0] - before[0]) / elapsed,
                    (asked[1] - before[1]) / elapsed,
                )
            else:  # first report, or a restart: what its window holds is its demand
                demand[key_id] = (w.requests / USED_KEPT_S, w.tokens / USED_KEPT_S)
        gateway.previous, gateway.demand = previous, demand
        return [self._allowance(gateway_id, key, now) for key in limited]

    def forget(self, gateway_id: str) -> None:
        self._gateways.pop(gateway_id, None)

    def _allowance(self, gateway_id: str, key: LimitedKey, now: float) -> KeyAllowance:
        live = [g for g, gw in self._gateways.items() if self._live(gw, now)]
        silent = [gw for gw in self._gateways.values() if not self._live(gw, now)]  # < 1 min
        others = [gw for g, gw in self._gateways.items() if g != gateway_id]
        gateway = self._gateways[gateway_id]
        index = live.index(gateway_id)
        kinds: dict[str, int] = {}
        for kind, limit in (
            ("rpm", key.rpm),
            ("tpm", key.tpm),
            ("max_concurrency", key.max_concurrency),
        ):
            if limit == 0:
                kinds[kind] = 0
                continue
            used = [self._used(self._gateways[g], key.key_id, kind) for g in live]
            demand = [self._demand(self._gateways[g], key.key_id, kind) for g in live]
            held = sum(self._committed(gw, key.key_id, kind) for gw in silent)
            target = split_budget(max(0, limit - held), used, demand, self.reserve)[index]
            # never more than the others' parts, as they were given, leave: they may use
            # them until their next report, so the parts never sum over the limit
            left = limit - sum(self._committed(gw, key.key_id, kind) for gw in others)
            kinds[kind] = max(used[index], min(target, left))
        allowance = KeyAllowance(key_id=key.key_id, whole=len(live) == 1 and not silent, **kinds)
        gateway.allowances[key.key_id] = allowance
        return allowance

    def _committed(self, gateway: _Gateway, key_id: str, kind: str) -> int:
        """What ``gateway`` may hold of a key now: its part as last given (it may use it
        until its next report), at least what its window held."""
        used = self._used(gateway, key_id, kind)
        given = gateway.allowances.get(key_id)
        return max(used, int(getattr(given, kind))) if given is not None else used

    @staticmethod
    def _used(gateway: _Gateway, key_id: str, kind: str) -> int:
        w = gateway.windows.get(key_id)
        if w is None:
            return 0
        return {"rpm": w.requests, "tpm": w.tokens, "max_concurrency": w.in_flight}[kind]

    @staticmethod
    def _demand(gateway: _Gateway, key_id: str, kind: str) -> float:
        requests, tokens = gateway.demand.get(key_id, (0.0, 0.0))
        return tokens if kind == "tpm" else requests

    @staticmethod
    def _live(gateway: _Gateway, now: float) -> bool:
        return now - gateway.reported_at <= STALE_INTERVALS * gateway.interval_s

    def _forget_silent(self, now: float) -> None:
        """Forget gateways silent for longer than a minute (nothing of theirs counts)."""
        for g in [g for g, gw in self._gateways.items() if now - gw.reported_at > USED_KEPT_S]:
            del self._gateways[g]

    def _make_room(self) -> None:
        """Forget the longest silent gateways past the cap."""
        while len(self._gateways) >= self.max_gateways:
            oldest = min(self._gateways, key=lambda g: self._gateways[g].reported_at)
            del self._gateways[oldest]


def _limited(key: LimitedKey) -> bool:
    return bool(key.rpm or key.tpm or key.max_concurrency)


__all__ = ["DEFAULT_RESERVE", "FleetSplit", "LimitedKey", "split_budget"]
