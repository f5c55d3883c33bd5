"""The routing table: which replicas serve which model, and where.

The gateway asks `RoutingTable.candidates(model)` once per request, so every read is an
O(1) lookup of tuples rebuilt on each change. A request's ``model`` is a served model name
or the name of a LoRA adapter a replica serves beside it (`Target.adapters`, vLLM's
``--lora-modules``): both route to that replica (changes are rare: a replica becomes READY,
drains, or goes away). Writers are the control-plane feed (in-process server or the
`llmgw gateway` router stream); everything runs on one event loop, so no locks.

`on_removed` callbacks tell the policies to forget a replica: they fire, after the table
has changed, for every replica id that was READY and now is gone, no longer READY, or
serves another model, and for every id removed outright. `on_changed` callbacks fire after
every change of the targets or of the scalable models.

The table also holds the **scalable** models (the feed's ``ScalableModels``): those the
autoscaler starts a replica for when none is READY, so the gateway holds a request for one
(``llmgw.gateway.holding``) instead of answering 404 or 503.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    """One replica as the gateway sees it."""

    replica_id: str
    model: str  # served model name: the routing key (`model` in the request)
    url: str  # leader endpoint "http://HOST:PORT", no trailing slash
    # sent upstream as "Authorization: Bearer KEY" ("" → no header); a secret, not in repr
    api_key: str = field(default="", repr=False)
    ready: bool = True  # only READY replicas are routed to; DRAINING etc. → ready=False
    deployment: str = ""
    kv_events: bool = False
    adapters: tuple[str, ...] = ()  # LoRA adapters' names: requests naming one route here too

    def serves(self, model: str) -> bool:
        """Whether ``model`` is its served model name or one of its adapters."""
        return model == self.model or model in self.adapters


_NO_TARGETS: tuple[Target, ...] = ()


class RoutingTable:
    """Targets by replica id, with per-model tuples of READY targets precomputed."""

    def __init__(self, targets: Iterable[Target] = ()) -> None:
        self.version = 0
        self._by_id: dict[str, Target] = {}
        self._ready_by_model: dict[str, tuple[Target, ...]] = {}
        self._models: tuple[str, ...] = ()
        self._all: tuple[Target, ...] = ()
        self._callbacks: list[Callable[[str], None]] = []
        self._changed: list[Callable[[], None]] = []
        self._scalable: frozenset[str] = frozenset()
        self.replace_all(targets)

    def replace_all(self, targets: Iterable[Target]) -> None:
        """Make the table exactly `targets` (a later duplicate id wins)."""
        self._apply({target.replica_id: target for target in targets})

    def upsert(self, target: Target) -> None:
        """Add or replace one target."""
        if self._by_id.get(target.replica_id) == target:
            return
        self._apply({**self._by_id, target.replica_id: target})

    def remove(self, replica_id: str) -> None:
        """Drop one target; unknown ids are ignored."""
        if replica_id not in self._by_id:
            return
        new = dict(self._by_id)
        del new[replica_id]
        self._apply(new)

    def get(self, replica_id: str) -> Target | None:
        return self._by_id.get(replica_id)

    def candidates(self, model: str) -> tuple[Target, ...]:
        """READY targets serving `model` (by name or as a LoRA adapter), sorted by
        replica id."""
        return self._ready_by_model.get(model, _NO_TARGETS)

    def models(self) -> tuple[str, ...]:
        """Models (and LoRA adapters) with at least one READY target, sorted."""
        return self._models

    def targets(self) -> tuple[Target, ...]:
        """All targets, READY or not, sorted by replica id."""
        return self._all

    def on_removed(self, callback: Callable[[str], None]) -> None:
        """Call `callback(replica_id)` when a replica is gone or no longer routable."""
        self._callbacks.append(callback)

    def on_changed(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after each change of the targets or the scalable models."""
        self._changed.append(callback)

    def set_scalable(self, models: Iterable[str]) -> None:
        """Make the scalable models exactly `models` (the feed's ``ScalableModels``)."""
        scalable = frozenset(models)
        if scalable != self._scalable:
            self._scalable = scalable
            self._notify_changed()

    def scalable(self, model: str) -> bool:
        """Whether the autoscaler starts a replica of `model` when none is READY."""
        return model in self._scalable

    def scalable_models(self) -> frozenset[str]:
        return self._scalable

    def _apply(self, new: dict[str, Target]) -> None:
        if new == self._by_id:
            return
        gone = _removed_ids(self._by_id, new)
        self._by_id = new
        self._reindex()
        self.version += 1
        for replica_id in gone:
            self._notify(replica_id)
        self._notify_changed()

    def _reindex(self) -> None:
        self._all = tuple(sorted(self._by_id.values(), key=_by_replica_id))
        ready: dict[str, list[Target]] = {}
        for target in self._all:
            if target.ready:
                for name in dict.fromkeys((target.model, *target.adapters)):
                    ready.setdefault(name, []).append(target)
        self._ready_by_model = {model: tuple(group) for model, group in ready.items()}
        self._models = tuple(sorted(self._ready_by_model))

    def _notify(self, replica_id: str) -> None:
        for callback in self._callbacks:
            try:
                callback(replica_id)
            except Exception:  # a listener's bug must not stop the table from updating
                logger.exception("on_removed callback failed for replica %s", replica_id)

    def _notify_changed(self) -> None:
        for callback in self._changed:
            try:
                callback()
            except Exception:  # a listener's bug must not stop the table from updating
                logger.exception("on_changed callback failed")


def _by_replica_id(target: Target) -> str:
    return target.replica_id


def _removed_ids(old: dict[str, Target], new: dict[str, Target]) -> list[str]:
    """Ids that were removed, or were READY and are no longer routable the same way."""
    gone: list[str] = []
    for replica_id, before in sorted(old.items()):
        after = new.get(replica_id)
        if after is None:
            gone.append(replica_id)
        elif before.ready and (
            not after.ready or (after.model, after.adapters) != (before.model, before.adapters)
        ):
            gone.append(replica_id)
    return gone
