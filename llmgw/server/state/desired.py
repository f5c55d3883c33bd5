"""Desired state: engine profiles and deployments, checked, kept durably and published.

An apply arrives as an ``ApplyDeploymentRequest``: one deployment (or none, to store
profiles only), the profiles it brings, and, when it came from a file, the file's text.
A request that holds only a document applies the whole document (:func:`check_document`,
`DesiredState.apply_all`): every profile and deployment in one transaction, so a file of
any size costs one request and one parse (``llmgw apply`` sends files so).

**What the server trusts.** The structured fields are what gets stored: every API client
(the CLI, the console, grpcurl) can send them, and not every one has a TOML file. They are
never trusted as sent: :func:`check_apply` writes them out as a document and reads it back
with :func:`~llmgw.server.core.profiles.parse_document`, so a request meets exactly the rules a
file meets, with problems named by the same key paths, and what is stored has every
default filled in. When ``document`` is set the server parses it too, whole (a client that
skipped its own check is refused with every problem of the file), and the structured
deployment and profiles must equal the document's entries of the same names: what is stored
is then what the operator's file says.

A deployment may name a profile that the request does not bring but the server already
stores (:func:`parse_with_profiles`); a profile known nowhere is refused by name.

:class:`DesiredState` keeps the checked state in memory, writes each change to the store
before it is visible (and before the RPC answers), and publishes ``deployment`` and
``deployment_removed`` Watch events. A dry run's diff is ``llmgw.server.state.placer``'s.

**The autoscaler's count.** An apply (not a live edit) of a deployment in autoscale mode
"act" stores the count it already has, within the policy's new ``[min, max]``
(:meth:`DesiredState.kept`): the file says the bounds, the autoscaler says the count, and
applying the same file again changes nothing. The autoscaler's own changes are live edits
(:meth:`DesiredState.update`), like ``llmgw scale``'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    Deployment,
    EngineProfile,
    WatchEvent,
)
from llmgw.server.core.deployment_keys import kept_count
from llmgw.server.core.fingerprint import profile_fingerprint, remembered
from llmgw.server.core.profiles import CPU_CLASS, Document, parse_document
from llmgw.server.core.profiles import render_document as _render
from llmgw.server.errors import ProfileError
from llmgw.server.state.history import affected, revise
from llmgw.server.state.statefile import unreadable_row
from llmgw.server.state.store import Store, now_ms
from llmgw.server.state.storeschema import RevisionRecord, StoredDeployment, StoredProfile
from llmgw.server.state.watch import WatchHub

__all__ = [
    "MESSAGE_LIMIT", "Change", "DesiredState", "check_apply", "check_document",
    "parse_with_profiles", "refusal", "shorten",
]  # fmt: skip

log = logging.getLogger(__name__)

MESSAGE_LIMIT = 2000
"""The most characters of an ActionResult message or a gRPC error (grpcio refuses > 16 KiB)."""
_SHOWN_PROBLEMS = 10


@dataclass(frozen=True, slots=True)
class Change:
    """A checked apply: the profiles to store and the deployment (None: profiles only)."""

    profiles: tuple[EngineProfile, ...]
    deployment: Deployment | None
    profile: EngineProfile | None  # the profile the deployment uses (brought or stored)

    @property
    def target(self) -> str:
        """What the audit log names: ``deployment/NAME``, else ``profile/A,B``."""
        if self.deployment is not None:
            return f"deployment/{self.deployment.name}"
        return "profile/" + ",".join(p.name for p in self.profiles)


# --- checking ----------------------------------------------------------------------------


def parse_with_profiles(
    text: str, stored: Mapping[str, EngineProfile], *, source: str = "<input>"
) -> Document:
    """Parse a document whose deployments may also name profiles in ``stored``.

    The result holds only the document's own profiles; a deployment's profile is in it or
    in ``stored``. Raises :class:`ProfileError` with every problem, as ``parse_document``.
    """
    borrowed = _borrowed(text, stored)
    if not borrowed:
        return parse_document(text, source=source)
    extra = _render(Document(MappingProxyType(borrowed), MappingProxyType({})))
    # The extra tables sit after the operator's text, so its line numbers stay right.
    full = parse_document(f"{text}\n{extra}", source=source)
    own = {k: v for k, v in full.profiles.items() if k not in borrowed}
    return Document(MappingProxyType(own), full.deployments)


def _borrowed(text: str, stored: Mapping[str, EngineProfile]) -> dict[str, EngineProfile]:
    """The stored profiles that ``text``'s deployments name and it does not define."""
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError):
        return {}  # parse_document reports it
    profiles = data.get("profiles", {})
    deployments = data.get("deployments", {})
    if not isinstance(profiles, dict) or not isinstance(deployments, dict):
        return {}
    named = {d.get("profile") for d in deployments.values() if isinstance(d, dict)}
    wanted = sorted(n for n in named if isinstance(n, str) and n not in profiles)
    return {n: stored[n] for n in wanted if n in stored}


def check_apply(request: ApplyDeploymentRequest, stored: Mapping[str, EngineProfile]) -> Change:
    """The checked change ``request`` asks for; :class:`ProfileError` with every problem."""
    brought: dict[str, EngineProfile] = {}
    twice = []
    for profile in request.profiles:
        if profile.name in brought:
            twice.append(f"profiles.{profile.name}: given twice in one request")
        brought[profile.name] = _with_defaults(profile)
    if twice:
        raise ProfileError(tuple(twice), source="request")
    deployment = request.deployment
    if deployment is None and not brought:
        raise ProfileError(("the request holds no deployment and no profile",), source="request")
    deployments = {deployment.name: deployment} if deployment is not None else {}
    text = _render(Document(MappingProxyType(brought), MappingProxyType(deployments)))
    checked = parse_with_profiles(text, stored, source="request")
    if request.document:
        _same_as_document(checked, parse_with_profiles(request.document, stored, source="document"))
    return _change(checked, stored)


def check_document(text: str, stored: Mapping[str, EngineProfile]) -> list[Change]:
    """The changes a whole document asks for, in its order: the profiles no deployment of
    it uses (one change), then one per deployment with the profile it brings (if the
    document defines it). :class:`ProfileError` with every problem, or when it is empty."""
    document = parse_with_profiles(text, stored, source="document")
    used = {d.profile for d in document.deployments.values()}
    alone = tuple(p for name, p in document.profiles.items() if name not in used)
    changes = [Change(alone, None, None)] if alone else []
    for deployment in document.deployments.values():
        brought = document.profiles.get(deployment.profile)
        profile = brought or stored[deployment.profile]
        changes.append(Change((brought,) if brought else (), deployment, profile))
    if not changes:
        raise ProfileError(("holds no profiles and no deployments",), source="document")
    return changes


_INLINE_CHANGES = 64  # more changes than this are serialized in a thread


def _rows(
    changes: Sequence[Change], at: int
) -> tuple[dict[str, EngineProfile], list[Deployment], list[StoredProfile], list[StoredDeployment]]:
    """What `DesiredState.apply_all` keeps and stores: the profiles, the deployments
    stamped ``at``, and their store rows."""
    profiles = {p.name: p for change in changes for p in change.profiles}
    deployments = []
    for change in changes:
        if change.deployment is not None:
            deployment = Deployment.parse(bytes(change.deployment))
            deployment.updated_unix_ms = at
            deployment.status = None  # computed by the server, never stored
            deployments.append(deployment)
    stored_profiles = [
        StoredProfile(p.name, bytes(p), profile_fingerprint(p), at) for p in profiles.values()
    ]
    stored_deployments = [StoredDeployment(d.name, bytes(d), at) for d in deployments]
    return profiles, deployments, stored_profiles, stored_deployments


def _with_defaults(profile: EngineProfile) -> EngineProfile:
    """A copy with unset sizes and names as a file would default them (0 means unset)."""
    out = EngineProfile.parse(bytes(profile))
    if out.gpu_class != CPU_CLASS:
        out.tp, out.pp, out.nodes = out.tp or 1, out.pp or 1, out.nodes or 1
        out.gpus_per_node = out.gpus_per_node or max(1, out.tp * out.pp // out.nodes)
    if not out.served_model_name and out.model_path:
        out.served_model_name = out.model_path.rstrip("/").rsplit("/", 1)[-1]
    return out


def _same_as_document(checked: Document, document: Document) -> None:
    problems = [
        f"{kind}.{name}: differs from the document's {kind}.{name}"
        for kind, mine, theirs in (
            ("profiles", checked.profiles, document.profiles),
            ("deployments", checked.deployments, document.deployments),
        )
        for name, value in mine.items()
        if name not in theirs or bytes(theirs[name]) != bytes(value)
    ]
    if problems:
        raise ProfileError(tuple(problems), source="request")


def _change(checked: Document, stored: Mapping[str, EngineProfile]) -> Change:
    deployment = next(iter(checked.deployments.values()), None)
    profile = None
    if deployment is not None:
        profile = checked.profiles.get(deployment.profile) or stored[deployment.profile]
    return Change(tuple(checked.profiles.values()), deployment, profile)


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[: limit - 40]}… ({len(text) - limit + 40} more characters)"


def refusal(exc: ProfileError) -> str:
    """A refused apply in one short line: its first problems, by key path."""
    shown = [f"{exc.source}: {p}" for p in exc.problems[:_SHOWN_PROBLEMS]]
    more = len(exc.problems) - len(shown)
    text = "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
    return shorten(text.replace("\n", " "))


# --- the state ---------------------------------------------------------------------------


class DesiredState:
    """Profiles and deployments in memory, kept in the store, published to watchers."""

    def __init__(self, store: Store, hub: WatchHub) -> None:
        self._store = store
        self._hub = hub
        self._lock = asyncio.Lock()
        self._edit_lock = asyncio.Lock()
        self.profiles: dict[str, EngineProfile] = {}
        self._fingerprint = remembered(profile_fingerprint)
        self.deployments: dict[str, Deployment] = {}
        # Each deployment as last applied (llmgw apply, ApplyDeployment), before any live
        # start, drain or reprofile edited it: a dry run says when a file undoes such an edit.
        # In memory only: after a restart it is the stored deployment.
        self.applied: dict[str, Deployment] = {}
        # Operator requests on replicas, stored (schema 4) and forgotten once carried out:
        self.retire: set[str] = set()  # replica ids an operator drained
        self.replace: set[str] = set()  # replica ids to replace by surge (a node drain)
        # How a published deployment shows (the plane adds its status); the stored one stays.
        self.shown: Callable[[Deployment], Deployment] = lambda deployment: deployment
        self.revisions: dict[str, RevisionRecord] = {}  # deployment → its latest revision

    async def load(self) -> None:
        """Read the stored profiles and deployments; a row that cannot be read is a
        StoreError naming it (the start stops: nothing stored is silently dropped)."""
        path = self._store.path
        for p in await self._store.load_profiles():
            self.profiles[p.name] = _read(EngineProfile, p.profile, path, "profiles", p.name)
        for d in await self._store.load_deployments():
            self.deployments[d.name] = _read(Deployment, d.deployment, path, "deployments", d.name)
            self.applied[d.name] = self.deployments[d.name]
        for replica_id, kind in await self._store.load_requests():
            self._requests(kind).add(replica_id)
        self.revisions = {r.deployment: r for r in await self._store.load_revisions()}
        log.info(
            "restored %d profiles, %d deployments and %d replica requests",
            len(self.profiles),
            len(self.deployments),
            len(self.retire) + len(self.replace),
        )

    def _requests(self, kind: str) -> set[str]:
        return self.retire if kind == "retire" else self.replace

    def fingerprint(self, profile_name: str) -> str:
        """The fingerprint of a stored profile, or "" when there is none by that name (once
        per stored profile: an apply stores new profile objects, never changes one)."""
        profile = self.profiles.get(profile_name)
        return self._fingerprint(profile) if profile is not None else ""

    async def apply(self, change: Change, *, retire: str = "", live: bool = False) -> None:
        """Store ``change`` (and a request to retire replica ``retire``) durably, in one
        transaction, then make both visible at once and publish the change. ``live``: an
        operator's action edited the deployment (it is not what was applied)."""
        await self.apply_all([change], retire=retire, live=live)

    async def apply_all(
        self, changes: Sequence[Change], *, retire: str = "", live: bool = False
    ) -> None:
        """`apply` for several changes (a whole document): one transaction, visible at once."""
        async with self._lock:
            at = now_ms()
            if not live:
                changes = self.kept(changes)
            if len(changes) > _INLINE_CHANGES:  # many rows to encode: off the event loop
                rows = await asyncio.to_thread(_rows, changes, at)
            else:
                rows = _rows(changes, at)
            profiles, deployments, stored_profiles, stored_deployments = rows
            revisions = revise(
                self.revisions,
                affected(deployments, profiles, self.deployments),
                {**self.profiles, **profiles},
                at_ms=at,
            )
            await self._store.save_desired(
                stored_profiles,
                stored_deployments,
                [(retire, "retire")] if retire else [],
                revisions=revisions,
            )
            self.revisions.update((r.deployment, r) for r in revisions)
            if retire:
                self.retire.add(retire)
            self.profiles.update(profiles)
            if profiles:  # the replaced profiles' answers let go
                self._fingerprint = remembered(profile_fingerprint)
            for deployment in deployments:
                self.deployments[deployment.name] = deployment
                if not live or deployment.name not in self.applied:
                    self.applied[deployment.name] = deployment
                self._hub.publish(WatchEvent(deployment=self.shown(deployment)))

    def kept(self, changes: Sequence[Change]) -> list[Change]:
        """``changes`` with each deployment's count as an apply stores it: a deployment
        the autoscaler owns (mode "act") keeps its stored count within its new
        ``[min, max]``, and a new one starts at ``min``
        (:func:`~llmgw.server.core.deployment_keys.kept_count`); others as they are."""
        return [self._kept(change) for change in changes]

    def _kept(self, change: Change) -> Change:
        applied = change.deployment
        if applied is None:
            return change
        count = kept_count(applied, self.deployments.get(applied.name))
        if count == applied.replicas:
            return change
        deployment = Deployment.parse(bytes(applied))
        deployment.replicas = count
        return dataclasses.replace(change, deployment=deployment)

    async def update(
        self, name: str, edit: Callable[[Deployment], None], *, retire: str = ""
    ) -> Deployment | None:
        """Edit a stored deployment (its count or profile) and, with it, retire a replica.

        Edits run one at a time (two drains lower the count twice). The edit and the retire
        request are stored in one transaction and become visible in the same turn of the
        event loop, so a reconciliation round (which reads both at once) sees both or
        neither, before and after a restart. None when there is no deployment ``name``.
        """
        async with self._edit_lock:
            current = self.deployments.get(name)
            if current is None:
                return None
            deployment = Deployment.parse(bytes(current))
            edit(deployment)
            await self.apply(Change((), deployment, None), retire=retire, live=True)
            return deployment

    async def request_replace(self, replica_ids: Sequence[str]) -> None:
        """Ask, durably, for these replicas to be replaced elsewhere by surge (node drain)."""
        await self._store.save_requests([(r, "replace") for r in replica_ids])
        self.replace.update(replica_ids)

    async def cancel_replace(self, replica_ids: Sequence[str]) -> list[str]:
        """Forget, durably, the replace requests of these replicas (an uncordon cancels a
        node drain): they stay where they run. The ids whose request was dropped, sorted;
        a retire request (an operator's drain) is kept."""
        cancelled = sorted(self.replace.intersection(replica_ids) - self.retire)
        if cancelled:
            await self._store.forget_requests(cancelled)
            self.replace.difference_update(cancelled)
        return cancelled

    async def keep_requests(self, live: set[str]) -> None:
        """Forget (here and in the store) the requests of replicas no longer ACTIVE or SURGE."""
        done = sorted((self.retire | self.replace) - live)
        self.retire &= live
        self.replace &= live
        await self._store.forget_requests(done)

    async def delete(self, name: str) -> bool:
        """Forget a deployment durably and publish it; False when there is none."""
        async with self._lock:
            if name not in self.deployments:
                return False
            await self._store.delete_deployment(name)
            del self.deployments[name]
            self.revisions.pop(name, None)
            self.applied.pop(name, None)
            self._hub.publish(WatchEvent(deployment_removed=name))
            return True


def _read(kind: Any, blob: bytes, path: Path | str, table: str, name: str) -> Any:
    try:
        message = kind.parse(blob)
    except Exception as exc:  # whatever the row holds, it is named, never dropped
        raise unreadable_row(path, table, name, exc) from exc
    if message.name != name:
        raise unreadable_row(path, table, name, f"it holds {message.name!r}")
    return message
