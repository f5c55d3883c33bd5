"""``RolloutHistory`` and ``RolloutUndo``: a deployment's profile revisions, and going back
to one (``llmgw.server.state.history`` records them).

Undo points the deployment at the revision's profile again: the one before the current by
default, or the one named. When the profile of that name is stored with the content it had
then, only the deployment changes; when the profile was changed since (another
fingerprint), its content of then is stored again, unless another deployment uses it (that
would roll it too: refused, naming them). A revision whose profile no longer exists is
refused, saying so. Undo is a new revision itself (cause ``rollout undo to revision N``),
as in kubectl.

Capacity: the reconciler rolls a deployment onto another profile by a surge of one
(``llmgw.server.core.reconciler``): it places one replica of the new profile beside the
old ones, waits until every shard of it is READY, and only then retires one old replica.
So READY replicas never drop below the count while there is room for the surge; without
room the roll waits (the reconciler says why in the audit log) and nothing old is stopped.
"""

from __future__ import annotations

from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    Deployment,
    EngineProfile,
    ProfileRevision,
    RolloutHistoryResponse,
)
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.errors import ActionRefused, quoted
from llmgw.server.state.desired import Change
from llmgw.server.state.history import ACTING
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.storeschema import RevisionRecord

__all__ = ["history", "undo"]


def _deployment(plane: ControlPlane, name: str) -> Deployment:
    deployment = plane.desired.deployments.get(name)
    if deployment is None:
        raise ActionRefused(Status.NOT_FOUND, f"no deployment named {quoted(name)}")
    return Deployment.parse(bytes(deployment))  # a copy: the stored one changes on apply


async def history(plane: ControlPlane, name: str) -> RolloutHistoryResponse:
    """The revisions of deployment ``name`` the store keeps, oldest first."""
    _deployment(plane, name)
    latest = plane.desired.revisions.get(name)
    return RolloutHistoryResponse(
        deployment=name,
        revisions=[_revision(r) for r in await plane.store.load_revisions(name)],
        current=latest.revision if latest is not None else 0,
    )


def _revision(record: RevisionRecord) -> ProfileRevision:
    return ProfileRevision(
        revision=record.revision,
        profile=record.profile,
        fingerprint=record.fingerprint,
        at_unix_ms=record.at_ms,
        actor=record.actor,
        cause=record.cause,
    )


async def undo(plane: ControlPlane, name: str, to_revision: int) -> str:
    """Point deployment ``name`` at revision ``to_revision``'s profile (0: the previous)."""
    deployment = _deployment(plane, name)
    target = _target(name, await plane.store.load_revisions(name), plane, to_revision)
    profile, restored = _profile_of(plane, target, name)
    deployment.profile = target.profile
    ACTING.set((ACTING.get()[0], f"rollout undo to revision {target.revision}"))
    await plane.desired.apply(Change(restored, deployment, profile))
    plane.reconcile_soon()
    again = "; its profile's content of then stored again" if restored else ""
    n = deployment.replicas
    return (
        f"deployment {name} rolled back to revision {target.revision}: profile "
        f"{target.profile} ({target.fingerprint}){again}; rolling replacement of {n} "
        f"replica{'' if n == 1 else 's'}, one at a time (each new one READY before an old one "
        "drains)"
    )


def _target(
    name: str, records: list[RevisionRecord], plane: ControlPlane, to_revision: int
) -> RevisionRecord:
    latest = plane.desired.revisions.get(name)
    if latest is None or not records:
        why = f"deployment {name} has no recorded revision: nothing to undo"
        raise ActionRefused(Status.FAILED_PRECONDITION, why)
    if to_revision == 0:
        earlier = [r for r in records if r.revision < latest.revision]
        if not earlier:
            why = f"deployment {name} has only revision {latest.revision}: nothing to undo to"
            raise ActionRefused(Status.FAILED_PRECONDITION, why)
        return earlier[-1]
    by_number = {r.revision: r for r in records}
    if to_revision not in by_number:
        kept = ", ".join(str(r.revision) for r in records)
        why = f"deployment {name} has no revision {to_revision} (kept: {kept})"
        raise ActionRefused(Status.NOT_FOUND, why)
    if to_revision == latest.revision:
        why = f"revision {to_revision} is deployment {name}'s current one: nothing changed"
        raise ActionRefused(Status.FAILED_PRECONDITION, why)
    return by_number[to_revision]


def _profile_of(
    plane: ControlPlane, target: RevisionRecord, name: str
) -> tuple[EngineProfile, tuple[EngineProfile, ...]]:
    """The profile to point at, and the profiles to store again (its old content)."""
    stored = plane.desired.profiles.get(target.profile)
    if stored is None:
        why = (
            f"revision {target.revision}'s profile {target.profile} no longer exists: "
            "apply it again, or undo to another revision"
        )
        raise ActionRefused(Status.FAILED_PRECONDITION, why)
    if profile_fingerprint(stored) == target.fingerprint:
        return stored, ()
    users = sorted(
        d.name
        for d in plane.desired.deployments.values()
        if d.profile == target.profile and d.name != name
    )
    if users:
        why = (
            f"profile {target.profile} changed since revision {target.revision} (now "
            f"{profile_fingerprint(stored)}, then {target.fingerprint}) and deployments "
            f"{', '.join(users)} use it: restoring it would roll them too; apply the old "
            "profile under another name instead"
        )
        raise ActionRefused(Status.FAILED_PRECONDITION, why)
    restored = EngineProfile.parse(target.content)
    return restored, (restored,)
