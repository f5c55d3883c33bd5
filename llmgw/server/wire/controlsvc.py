"""``ControlService``: the operator API, on the native gRPC port and over gRPC-web.

Desired state: ``ApplyDeployment`` checks the request (``llmgw.server.state.desired``: the server
never trusts a client's check), then either answers a dry run's placement plan (changing
nothing: no store write, no event, no audit record) or stores the change durably before
answering. Every apply and delete, refused or not, lands in the audit log with the actor,
the action, the target and the result. A refused apply answers INVALID_ARGUMENT with its
first problems by key path, cut short (grpcio refuses a trailer over 16 KiB).

Operator actions on replicas and nodes (start, drain, reprofile, drain a node) are
``llmgw.server.wire.actions``; each is audited with the result "ok: WHAT" or "refused: WHY",
and a refusal answers the action's status and changes nothing. The audit actor is the
caller's token (``llmgw.server.wire.auth.current_actor``), or ``operator`` with authentication off.

``ListProfiles`` shows profiles' env values (where HF tokens go) to admins only: any other
caller gets each value as ``<redacted>``, its name kept (``llmgw.server.wire.auth.sees_secrets``).
Profiles reach clients through ListProfiles and Describe only (Watch and GetCluster carry
none), redacted alike.

``Describe`` (``llmgw.server.wire.describe``) answers everything known about a deployment,
replica or node with its recent events; ``ScaleDeployment`` sets a deployment's count (an
action, audited as ``scale``); ``RolloutHistory`` and ``RolloutUndo``
(``llmgw.server.wire.rollout``) list a deployment's profile revisions and go back to one
(audited as ``rollout-undo``). Each call that changes desired state sets
``llmgw.server.state.history.ACTING`` (the caller, the action) for the revision it records.

``CreateKey``, ``ListKeys`` and ``RevokeKey`` (tenants' gateway keys, admin only) are
``llmgw.server.wire.tenantkeys``'s: checked, audited, only a key's SHA-256 stored.

``StreamLogs`` reads a shard's engine output from its node's agent
(``llmgw.server.wire.logrelay``, given as ``logs``: the one the AgentService feeds).

``GetRouterStats`` answers the fleet's routing figures: the in-server gateway's counters,
read through ``gateway`` (a provider set by ``llmgw.server.app``; None, or a provider
answering None: the server runs no gateway), added to what separate gateways reported
(``reports``, filled by ``RouterService.Report``; ``llmgw.server.wire.routerreports`` says how
they add up). With no in-server gateway and no gateway ever reported, it answers
FAILED_PRECONDITION saying so. Counters are cumulative and never go backwards while the
server runs; clients compute windowed rates from deltas.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    Cluster,
    ControlServiceBase,
    CreateKeyRequest,
    CreateKeyResponse,
    DeleteDeploymentRequest,
    DeleteNodeRequest,
    Deployment,
    DescribeRequest,
    Description,
    EngineProfile,
    GetClusterRequest,
    GetRouterStatsRequest,
    ListKeysRequest,
    ListKeysResponse,
    ListProfilesRequest,
    ListProfilesResponse,
    LogLines,
    LogsRequest,
    NodeRequest,
    ReplicaRequest,
    ReprofileReplicaRequest,
    RevokeKeyRequest,
    RolloutHistoryRequest,
    RolloutHistoryResponse,
    RolloutUndoRequest,
    RouterStats,
    ScaleRequest,
    UsageRequest,
    UsageResponse,
    WatchEvent,
    WatchRequest,
)
from llmgw.gateway import Gateway, router_stats
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.errors import ProfileError, UnknownNode, quoted
from llmgw.server.state.desired import (
    MESSAGE_LIMIT,
    Change,
    check_apply,
    check_document,
    refusal,
    shorten,
)
from llmgw.server.state.history import ACTING
from llmgw.server.state.placer import plan_change
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.storeschema import AuditRecord
from llmgw.server.wire import actions, rollout
from llmgw.server.wire.auth import ANONYMOUS_ACTOR, REDACTED, current_actor, sees_secrets
from llmgw.server.wire.describe import describe
from llmgw.server.wire.dryrun import counted, plan_message, plan_summary
from llmgw.server.wire.logrelay import LogRelay, log_targets, merged
from llmgw.server.wire.routerreports import RouterReports, StatsPart, combine
from llmgw.server.wire.tenantkeys import TenantKeyCalls
from llmgw.server.wire.usage import usage_response

log = logging.getLogger(__name__)

OPERATOR = ANONYMOUS_ACTOR
"""The actor recorded in the audit log when authentication is off."""


GatewayProvider = Callable[[], Gateway | None]
"""The in-server gateway while it serves, else None (``GetRouterStats`` reads it)."""

NO_GATEWAY = "the server runs no gateway (--gateway-listen off) and no llmgw gateway has reported"


class ControlService(ControlServiceBase):
    """Operator RPCs over the control plane."""

    def __init__(
        self,
        plane: ControlPlane,
        gateway: GatewayProvider | None = None,
        reports: RouterReports | None = None,
        logs: LogRelay | None = None,
    ) -> None:
        self.plane = plane
        self.logs = logs if logs is not None else LogRelay()
        self.gateway: GatewayProvider = gateway if gateway is not None else lambda: None
        self.reports = reports if reports is not None else RouterReports()
        self._applying = asyncio.Lock()  # one apply at a time: each checks what the last stored
        self._keys = TenantKeyCalls(plane)

    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return self.plane.snapshot()

    async def watch(self, message: WatchRequest) -> AsyncIterator[WatchEvent]:
        async for event in self.plane.hub.subscribe():
            yield event

    async def stream_logs(self, message: LogsRequest) -> AsyncIterator[LogLines]:
        if message.previous and message.follow:
            raise GRPCError(
                Status.INVALID_ARGUMENT, "follow and previous together: the previous run ended"
            )
        targets = log_targets(self.plane, message.name, all_shards=message.all_shards)
        async for lines in merged([self.logs.stream(target, message) for target in targets]):
            yield lines

    async def cordon_node(self, message: NodeRequest) -> ActionResult:
        node_id = message.node_id
        try:
            await self.plane.set_cordoned(node_id, True, actor=current_actor())
        except UnknownNode as exc:
            raise GRPCError(Status.NOT_FOUND, str(exc)) from exc
        return ActionResult(ok=True, message=f"node {node_id} cordoned")

    async def uncordon_node(self, message: NodeRequest) -> ActionResult:
        """Uncordon; a drain of the node under way is cancelled (``actions.uncordon_node``).
        Audited by the plane as ``uncordon``, like a cordon."""
        try:
            text = await actions.uncordon_node(self.plane, message.node_id, actor=current_actor())
        except actions.ActionRefused as exc:
            raise GRPCError(exc.status, exc.why) from exc
        return ActionResult(ok=True, message=text)

    async def apply_deployment(self, message: ApplyDeploymentRequest) -> ActionResult:
        async with self._applying:
            return await self._apply_deployment(message)

    async def _apply_deployment(self, message: ApplyDeploymentRequest) -> ActionResult:
        ACTING.set((current_actor(), "apply"))
        if message.document and message.deployment is None and not message.profiles:
            return await self._apply_document(message)
        # Parsing a request's document takes time in proportion to its deployments (seconds
        # for a large file): off the event loop, so every port keeps answering.
        stored = dict(self.plane.desired.profiles)
        try:
            change = await asyncio.to_thread(check_apply, message, stored)
        except ProfileError as exc:
            text = refusal(exc)
            target = _requested_target(message)
            if not message.dry_run:
                await self.plane.audit(current_actor(), "apply", target, f"refused: {text}")
            raise GRPCError(Status.INVALID_ARGUMENT, text) from exc
        (change,) = self.plane.desired.kept([change])  # the autoscaler's count stays
        if message.dry_run:
            return self._dry_run([change])
        await self.plane.desired.apply(change)
        text = _applied(change)
        await self.plane.audit(current_actor(), "apply", change.target, f"ok: {text}")
        self.plane.reconcile_soon()
        result = ActionResult(ok=True)
        line = self._counted(result, [change])
        result.message = shorten(f"{text}\n{line}" if line else text)
        return result

    async def _apply_document(self, message: ApplyDeploymentRequest) -> ActionResult:
        """A whole document: parsed once, off the event loop, stored in one transaction;
        audited per change as one request each would be; the answer has a line per change."""
        stored = dict(self.plane.desired.profiles)
        try:
            changes = await asyncio.to_thread(check_document, message.document, stored)
        except ProfileError as exc:
            text = refusal(exc)
            if not message.dry_run:
                await self.plane.audit(current_actor(), "apply", "document", f"refused: {text}")
            raise GRPCError(Status.INVALID_ARGUMENT, text) from exc
        changes = self.plane.desired.kept(changes)
        if message.dry_run:
            return self._dry_run(changes)
        await self.plane.desired.apply_all(changes)
        lines = [_applied(change) for change in changes]
        actor, at = current_actor(), int(time.time() * 1000)
        await self.plane.audit_all(
            [
                AuditRecord(at, actor, "apply", c.target, f"ok: {text}")
                for c, text in zip(changes, lines, strict=True)
            ]
        )
        self.plane.reconcile_soon()
        result = ActionResult(ok=True)
        line = self._counted(result, changes)
        result.message = _lines([line, *lines] if line else lines)
        return result

    def _dry_run(self, changes: Sequence[Change]) -> ActionResult:
        """The diff of ``changes`` against what runs now (``llmgw.server.state.placer``)."""
        deployments, profiles = _wanted(changes)
        plan, nodes = plan_change(self.plane, deployments, profiles, self.in_flight)
        text = plan_summary(plan)
        if profiles:
            text = f"dry run: would store profiles {', '.join(p.name for p in profiles)}\n{text}"
        result = ActionResult(ok=True, message=shorten(text), plan=plan_message(plan, nodes))
        result.desired, result.placeable = sum(plan.desired.values()), plan.placed
        return result

    def _counted(self, result: ActionResult, changes: Sequence[Change]) -> str:
        """Set how many replicas of the changed deployments can be placed; why not, or ""."""
        deployments, _ = _wanted(changes)
        if not deployments:
            return ""
        plan, _ = plan_change(self.plane, deployments, in_flight=self.in_flight)
        return counted(result, plan)

    async def delete_deployment(self, message: DeleteDeploymentRequest) -> ActionResult:
        target = f"deployment/{message.name}"
        if not await self.plane.desired.delete(message.name):
            text = f"no deployment named {quoted(message.name)}"
            await self.plane.audit(current_actor(), "delete", target, f"refused: {text}")
            raise GRPCError(Status.NOT_FOUND, text)
        await self.plane.audit(current_actor(), "delete", target, "ok")
        self.plane.reconcile_soon()
        return ActionResult(ok=True, message=f"deployment {message.name} deleted")

    async def start_replica(self, message: ReplicaRequest) -> ActionResult:
        target = _replica_target(message.deployment, message.replica_id)
        name = actions.deployment_of(self.plane, message.deployment, message.replica_id)
        result = await self._act(
            "start",
            target,
            actions.start_replica(self.plane, message.deployment, message.replica_id),
        )
        return self._with_counts(result, name)

    async def drain_replica(self, message: ReplicaRequest) -> ActionResult:
        target = f"replica/{message.replica_id[:64]}"
        return await self._act(
            "drain", target, actions.drain_replica(self.plane, message.replica_id)
        )

    async def reprofile_replica(self, message: ReprofileReplicaRequest) -> ActionResult:
        target = _replica_target(message.deployment, message.replica_id)
        name = actions.deployment_of(self.plane, message.deployment, message.replica_id)
        work = actions.reprofile(
            self.plane,
            message.deployment,
            message.replica_id,
            message.profile,
            allow_model_change=message.allow_model_change,
        )
        return self._with_counts(await self._act("reprofile", target, work), name)

    def _with_counts(self, result: ActionResult, name: str) -> ActionResult:
        """``result`` saying how many replicas of deployment ``name`` can be placed now."""
        deployment = self.plane.desired.deployments.get(name)
        if deployment is None:
            return result
        plan, _ = plan_change(self.plane, [deployment], in_flight=self.in_flight)
        if line := counted(result, plan):
            result.message = shorten(f"{result.message}\n{line}")
        return result

    async def drain_node(self, message: NodeRequest) -> ActionResult:
        if message.dry_run:  # changes nothing: no audit record; ok: every replica can move
            try:
                text, movable = actions.drain_preview(self.plane, message.node_id)
            except actions.ActionRefused as exc:
                raise GRPCError(exc.status, exc.why) from exc
            return ActionResult(ok=movable, message=text)
        work = actions.drain_node(self.plane, message.node_id, actor=current_actor())
        return await self._act("drain-node", f"node/{message.node_id[:64]}", work)

    async def delete_node(self, message: DeleteNodeRequest) -> ActionResult:
        work = actions.delete_node(self.plane, message.node_id, force=message.force)
        target = f"node/{message.node_id[:64]}"
        return await self._act("delete-node", target, work)

    async def _act(self, action: str, target: str, work: Coroutine[Any, Any, str]) -> ActionResult:
        """Run an operator action and audit it: "ok: WHAT" or "refused: WHY"."""
        ACTING.set((current_actor(), action))
        try:
            text = await work
        except actions.ActionRefused as exc:
            await self.plane.audit(current_actor(), action, target, f"refused: {exc.why}")
            raise GRPCError(exc.status, exc.why) from exc
        await self.plane.audit(current_actor(), action, target, f"ok: {text}")
        return ActionResult(ok=True, message=text)

    async def describe(self, message: DescribeRequest) -> Description:
        try:
            return await describe(self.plane, message.kind, message.name, _shown)
        except actions.ActionRefused as exc:
            raise GRPCError(exc.status, exc.why) from exc

    async def scale_deployment(self, message: ScaleRequest) -> ActionResult:
        work = actions.scale(self.plane, message.deployment, message.replicas)
        result = await self._act("scale", f"deployment/{message.deployment[:64]}", work)
        return self._with_counts(result, message.deployment)

    async def rollout_history(self, message: RolloutHistoryRequest) -> RolloutHistoryResponse:
        try:
            return await rollout.history(self.plane, message.deployment)
        except actions.ActionRefused as exc:
            raise GRPCError(exc.status, exc.why) from exc

    async def rollout_undo(self, message: RolloutUndoRequest) -> ActionResult:
        work = rollout.undo(self.plane, message.deployment, message.to_revision)
        result = await self._act("rollout-undo", f"deployment/{message.deployment[:64]}", work)
        return self._with_counts(result, message.deployment)

    async def list_profiles(self, message: ListProfilesRequest) -> ListProfilesResponse:
        profiles = self.plane.desired.profiles
        shown = [profiles[name] for name in sorted(profiles)]
        if not sees_secrets():
            shown = [_redacted(p) for p in shown]
        return ListProfilesResponse(profiles=shown)

    async def create_key(self, message: CreateKeyRequest) -> CreateKeyResponse:
        return await self._keys.create(message)

    async def list_keys(self, message: ListKeysRequest) -> ListKeysResponse:
        return await self._keys.list(message)

    async def revoke_key(self, message: RevokeKeyRequest) -> ActionResult:
        return await self._keys.revoke(message)

    async def get_usage(self, message: UsageRequest) -> UsageResponse:
        return await usage_response(self.plane, message)

    async def get_router_stats(self, message: GetRouterStatsRequest) -> RouterStats:
        gateway = self.gateway()
        if gateway is None and not self.reports.ever_reported:
            raise GRPCError(Status.FAILED_PRECONDITION, NO_GATEWAY)
        now_ms = int(time.time() * 1000)
        parts = self.reports.parts()
        if gateway is not None:  # read now: the freshest figures there are
            parts.append(StatsPart(router_stats(gateway, now_ms), live=True, fresh_s=math.inf))
        return combine(parts, now_ms)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per replica id now, summed over every live gateway's report
        and the in-server gateway (the reconciler's scale-in costs)."""
        now_ms = int(time.time() * 1000)
        parts = self.reports.parts()
        gateway = self.gateway()
        if gateway is not None:
            parts.append(StatsPart(router_stats(gateway, now_ms), live=True, fresh_s=math.inf))
        return {row.replica_id: row.in_flight for row in combine(parts, now_ms).replicas}


def _shown(profile: EngineProfile) -> EngineProfile:
    """``profile`` as the caller may see it: whole for admins, else env values redacted."""
    return profile if sees_secrets() else _redacted(profile)


def _wanted(changes: Sequence[Change]) -> tuple[list[Deployment], list[EngineProfile]]:
    deployments = [c.deployment for c in changes if c.deployment is not None]
    return deployments, [p for c in changes for p in c.profiles]


def _redacted(profile: EngineProfile) -> EngineProfile:
    """``profile`` with every env value replaced by ``REDACTED`` (a copy: the plane's stays)."""
    if not profile.env:
        return profile
    return replace(profile, env=dict.fromkeys(profile.env, REDACTED))


def _replica_target(deployment: str, replica_id: str) -> str:
    return f"replica/{replica_id[:64]}" if replica_id else f"deployment/{deployment[:64]}"


def _requested_target(message: ApplyDeploymentRequest) -> str:
    """The audit target of a refused request, its names cut short (they are the client's)."""
    if message.deployment is not None:
        return f"deployment/{message.deployment.name[:64]}"
    return "profile/" + ",".join(p.name[:64] for p in message.profiles[:10])


def _lines(lines: Sequence[str]) -> str:
    """One line each, within MESSAGE_LIMIT: as many whole lines as fit, then how many not."""
    shown: list[str] = []
    size = 0
    for i, line in enumerate(lines):
        size += len(line) + 1
        if size > MESSAGE_LIMIT - 60:
            shown.append(f"… and {len(lines) - i} more")
            break
        shown.append(line)
    return "\n".join(shown)


def _applied(change: Change) -> str:
    brought = ", ".join(p.name for p in change.profiles)
    if change.deployment is None or change.profile is None:
        return f"profiles {brought} stored"
    d, fingerprint = change.deployment, profile_fingerprint(change.profile)
    return (
        f"deployment {d.name} applied: profile {d.profile} ({fingerprint}), "
        f"{d.replicas} replica{'' if d.replicas == 1 else 's'}"
        + (f"; profiles stored: {brought}" if brought else "")
    )
