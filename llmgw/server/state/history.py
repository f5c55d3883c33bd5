"""What happened to each object, kept so that it survives a restart: the event history and
the profile revisions of deployments.

**Events.** ``llmgw describe`` reads two tables. The audit log (``Store.append_audits``)
holds the operator actions and the reconciler's decisions (actor ``reconciler``: each
placement with its node and GPUs, each replacement or retirement with its reason, each
"cannot be placed" of a deployment); it is read, never copied. The ``events`` table, filled
here, holds what no one decided: each state an agent reports for a shard (STARTING, READY,
FAILED with the agent's reason …), each node that turns NOT_READY (why) and each
registration.

Bounds: the table keeps the newest ``EVENTS_KEPT`` rows (10 000, across all objects), the
older ones deleted in the same transaction as each write; Describe shows the newest
``SHOWN`` (50) of an object and the objects it holds.

Writes never hold the event loop nor fail a caller: :meth:`History.note` appends to a
buffer in memory; :meth:`History.flush` (every tick of the plane) writes the buffer in one
transaction, on aiosqlite's thread. While the store cannot take writes (a full or read-only
disk: ``llmgw.server.state.storehealth``) the buffer is kept, at most ``PENDING_MAX`` events
(beyond, the oldest are dropped and counted in :attr:`History.dropped`), and tried again
with capped, jittered backoff. Describe reads the stored rows and the buffer together.

**Revisions.** Every change that gives a deployment another profile (another name, or the
same name with other content: another fingerprint) records a revision (``revise``): its
number (1, 2, … per deployment), the profile's name, fingerprint and content as they were,
when, who and the cause. ``ACTING`` carries who acts and why: the control service sets it
for each call; changes made with it unset are recorded as by ``unknown``. The store keeps
the newest ``llmgw.server.state.storehistory.REVISIONS_KEPT`` (20) of each deployment.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar

from llmgw.api.llmgw.v1 import Deployment, EngineProfile, Shard, ShardState
from llmgw.protocol import read_shard_state
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.errors import StoreUnwritable
from llmgw.server.state.store import Store, now_ms
from llmgw.server.state.storehealth import WriteRetry
from llmgw.server.state.storeschema import EventRecord, RevisionRecord

__all__ = [
    "ACTING", "EVENTS_KEPT", "PENDING_MAX", "SHOWN", "History", "revise", "state_word",
]  # fmt: skip

log = logging.getLogger(__name__)

EVENTS_KEPT = 10_000
"""Rows the ``events`` table keeps (the newest, across all objects)."""
PENDING_MAX = 1_000
"""Events held in memory while the store cannot take them; beyond, the oldest are dropped."""
SHOWN = 50
"""The most events Describe shows."""
_MESSAGE_CHARS = 500  # an agent's reason is its engine's last line: cut, not stored whole

ACTING: ContextVar[tuple[str, str]] = ContextVar("llmgw_acting", default=("unknown", ""))
"""(actor, cause) of the change being made, for its profile revision."""


def state_word(state: ShardState) -> str:
    """``READY`` for ``ShardState.READY``: how an event names a shard state."""
    return state.name.removeprefix("SHARD_STATE_") if state.name else str(int(state))


class History:
    """The event history: noted in memory at once, written to the store in batches."""

    def __init__(self, store: Store, *, keep: int = EVENTS_KEPT) -> None:
        self._store = store
        self._keep = keep
        self._pending: deque[EventRecord] = deque()
        self._retry = WriteRetry()
        self.dropped = 0  # events dropped while the store could not take them

    def note(
        self, obj: str, reason: str, message: str, *, actor: str, warning: bool = False
    ) -> None:
        """Record that ``reason`` (a state, an action) happened to ``obj``; written later."""
        if len(self._pending) >= PENDING_MAX:
            self._pending.popleft()
            self.dropped += 1
        text = message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS] + "…"
        self._pending.append(EventRecord(now_ms(), obj, actor, reason, text, warning))

    def node_down(self, node_id: str, reason: str) -> None:
        """Note that a node turned NOT_READY, and why."""
        self.note(f"node/{node_id}", "NOT_READY", reason, actor="server", warning=True)

    def shard_changed(self, node_id: str, before: Shard | None, after: Shard) -> None:
        """Note a shard's new state (when it changed), with its agent's reason."""
        status = after.status
        if status is None:
            return
        state = read_shard_state(status.state)
        old = before.status if before is not None else None
        if old is not None and read_shard_state(old.state) is state:
            return
        self.note(
            after.shard_id,
            state_word(state),
            status.reason or f"on node {node_id}",
            actor=f"node/{node_id}",
            warning=state is ShardState.FAILED,
        )

    async def flush(self, *, now: bool = False) -> None:
        """Write the buffer in one transaction; kept for later when the store refuses."""
        at = time.monotonic()
        if not self._pending or not (now or self._retry.due(at)):
            return
        batch, self._pending = self._pending, deque()
        try:
            await self._store.append_events(list(batch), keep=self._keep)
        except StoreUnwritable:
            self._retry.failed(at)
            self._pending.extendleft(reversed(batch))  # before what came meanwhile
            while len(self._pending) > PENDING_MAX:
                self._pending.popleft()
                self.dropped += 1
            return
        self._retry.succeeded()

    async def recent(self, objects: Iterable[str], limit: int = SHOWN) -> list[EventRecord]:
        """The newest ``limit`` events and audit records about ``objects``, oldest first."""
        wanted = sorted(set(objects))
        stored = await self._store.events_of(wanted, limit)
        held = [e for e in self._pending if e.object in set(wanted)]
        return sorted([*stored, *held], key=lambda e: e.at_ms)[-limit:]


def revise(
    latest: Mapping[str, RevisionRecord],
    deployments: Iterable[Deployment],
    profiles: Mapping[str, EngineProfile],
    *,
    at_ms: int,
) -> list[RevisionRecord]:
    """The revisions to record: one for each deployment whose profile (name, or content by
    fingerprint) differs from its latest revision's (or that has none)."""
    actor, cause = ACTING.get()
    out = []
    seen: dict[str, tuple[str, bytes]] = {}  # a profile many deployments use: encoded once
    for deployment in deployments:
        profile = profiles.get(deployment.profile)
        if profile is None:
            continue
        if profile.name not in seen:
            seen[profile.name] = (profile_fingerprint(profile), bytes(profile))
        fingerprint, content = seen[profile.name]
        last = latest.get(deployment.name)
        if last is not None and (last.profile, last.fingerprint) == (profile.name, fingerprint):
            continue
        number = last.revision + 1 if last is not None else 1
        out.append(
            RevisionRecord(
                deployment.name, number, profile.name, fingerprint, content, at_ms,
                actor, cause,
            )
        )  # fmt: skip
    return out


def affected(
    changed: Sequence[Deployment],
    profiles: Iterable[str],
    stored: Mapping[str, Deployment],
) -> list[Deployment]:
    """The deployments a change may give another profile: those it changes, and the stored
    ones that use a profile it stores."""
    names = {d.name for d in changed}
    touched = set(profiles)
    return [*changed, *(d for n, d in stored.items() if n not in names and d.profile in touched)]
