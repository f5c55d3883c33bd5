"""Desired state from the command line: ``llmgw apply``, ``delete deployment``, ``get
deployments|profiles`` and ``events`` (their flags are ``llmgw.cli.desired``'s and
``llmgw.cli.get``'s, which import this module when one of them runs).

``apply -f FILE`` parses the file here first, so a bad one is refused at once with every
problem by key path and nothing is sent; a deployment may name a profile the server already
stores (asked for with ListProfiles only when the file does not define it). Then the whole
file goes in one ApplyDeploymentRequest that holds only its text: the server checks it
again, once, off its event loop, and stores every profile and deployment in one
transaction (all or nothing), answering a line per deployment. A server from before
whole-file applies refuses such a request; then each deployment goes in its own request
with the profiles of the file it uses and the file's text, and profiles no deployment uses
go in one request of their own first (a failure between those requests leaves the file half
applied, and applying it again finishes it).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from grpclib.const import Status

from llmgw.api.llmgw.v1 import (
    ActionResult,
    ApplyDeploymentRequest,
    AuditEvent,
    Deployment,
    DeploymentStatus,
    EngineProfile,
    PlannedChange,
    WatchEvent,
)
from llmgw.cli.autoscale_text import decision_cell
from llmgw.cli.errors import CliError
from llmgw.cli.rollout_wait import wait_ready
from llmgw.cli.rpc import call
from llmgw.cli.tables import render_table
from llmgw.client import ControlClient, RpcError, Timeouts
from llmgw.printable import escape
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.profiles import CPU_CLASS, Document, parse_document
from llmgw.server.errors import ProfileError

# The desired-state helpers live with the server; this reads the document the same way.
from llmgw.server.state.desired import parse_with_profiles
from llmgw.server.wire.auth import REDACTED


def run_apply(
    server: str, path: Path, *, dry_run: bool, output: str, wait_s: float | None = None
) -> int:
    """``llmgw apply -f FILE``: 0 when every request was accepted and every replica it asks
    for can be placed (``wait_s``: and then, within it, is ready on its current profile);
    with ``dry_run``, the server's diff against what runs now (exit 0 only when everything
    can be placed)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    code, names = asyncio.run(_apply(server, text, str(path), dry_run=dry_run, output=output))
    if code or dry_run or wait_s is None or not names:
        return code
    return int(asyncio.run(call(server, lambda client: wait_ready(client, names, wait_s))))


async def _apply(
    server: str, text: str, source: str, *, dry_run: bool, output: str
) -> tuple[int, list[str]]:
    """The exit code, and the names of the file's deployments."""
    names: list[str] = []

    async def apply(client: ControlClient) -> list[tuple[str, ActionResult]]:
        document = await _parse(client, text, source)
        names.extend(document.deployments)
        requests = _requests(document, text, dry_run)  # checks the file is not empty
        whole = ApplyDeploymentRequest(dry_run=dry_run, document=text)
        try:
            return [(f"file {source}", await client.apply_deployment(whole))]
        except RpcError as exc:
            if exc.status is not Status.INVALID_ARGUMENT or _WHOLE_REFUSED not in exc.message:
                raise
        answers = []  # a server that takes one deployment per request
        for name, request in requests:
            answers.append((name, await client.apply_deployment(request)))
        return answers

    # A whole file is checked and stored in one call, which takes longer the larger the file:
    # the timeout grows by a second per 20 kB, enough for a slow, loaded machine.
    answers = await call(server, apply, Timeouts(call=30.0 + len(text) / 20_000))
    if dry_run:
        return _print_plan([result for _, result in answers], output), names
    if output == "json":
        rows = [
            {"target": target, "message": r.message, "desired": r.desired,
             "placeable": r.placeable}
            for target, r in answers
        ]  # fmt: skip
        sys.stdout.write(json.dumps({"applied": rows}, indent=2) + "\n")
    else:
        sys.stdout.write("".join(f"{r.message}\n" for _, r in answers))
    return (0 if all(r.placeable >= r.desired for _, r in answers) else 1), names


_PLAN_KEYS = ("action", "deployment", "replica", "profile", "from_profile", "node", "gpus",
              "port", "reason")  # fmt: skip


def _print_plan(results: Sequence[ActionResult], output: str) -> int:
    """A dry run's diff, as a table or JSON; 0 only when every replica can be placed."""
    changes = [c for r in results if r.plan is not None for c in r.plan.changes]
    placeable = all(r.plan is not None and r.plan.placeable for r in results)
    if output == "json":
        rows = [{key: _plan_value(c, key) for key in _PLAN_KEYS} for c in changes]
        sys.stdout.write(json.dumps({"placeable": placeable, "changes": rows}, indent=2) + "\n")
        return 0 if placeable else 1
    if changes:
        table = [["DEPLOYMENT", "ACTION", "REPLICA", "PROFILE", "NODE", "GPUS", "PORT", "REASON"]]
        table += [_plan_row(c) for c in changes]
        sys.stdout.write(render_table(table) + "\n")
    sys.stdout.write("".join(f"{r.message}\n" for r in results))
    return 0 if placeable else 1


def _plan_value(change: PlannedChange, key: str) -> Any:
    value = getattr(change, key)
    return list(value) if key == "gpus" else value


def _plan_row(c: PlannedChange) -> list[str]:
    profile = f"{c.from_profile} → {c.profile}" if c.from_profile else c.profile
    return [
        c.deployment, c.action, c.replica, profile, c.node or "-", ",".join(c.gpus) or "-",
        str(c.port) if c.port else "-", c.reason or "-",
    ]  # fmt: skip


_MISSING_PROFILE = ".profile: no profile named"
_WHOLE_REFUSED = "the request holds no deployment and no profile"  # servers before whole files


async def _parse(client: ControlClient, text: str, source: str) -> Document:
    try:
        return parse_document(text, source=source)
    except ProfileError as exc:
        if not all(_MISSING_PROFILE in p for p in exc.problems):
            raise CliError(str(exc)) from exc  # a bad file, whatever the server stores
        first = exc  # maybe the server stores the profiles it names
    stored = {p.name: p for p in await client.list_profiles()}
    try:
        return parse_with_profiles(text, stored, source=source)
    except ProfileError as exc:
        raise CliError(str(exc)) from first


def _requests(
    document: Document, text: str, dry_run: bool
) -> list[tuple[str, ApplyDeploymentRequest]]:
    used = {d.profile for d in document.deployments.values()}
    alone = [p for name, p in document.profiles.items() if name not in used]
    out = []
    if alone:
        target = "profiles " + ",".join(p.name for p in alone)
        out.append((target, ApplyDeploymentRequest(profiles=alone, dry_run=dry_run, document=text)))
    for name, deployment in document.deployments.items():
        mine = (
            [document.profiles[deployment.profile]]
            if deployment.profile in document.profiles
            else []
        )
        request = ApplyDeploymentRequest(
            deployment=deployment, profiles=mine, dry_run=dry_run, document=text
        )
        out.append((f"deployment {name}", request))
    if not out:
        raise CliError("the file holds no profiles and no deployments: nothing to apply")
    return out


async def run_delete(server: str, kind: str, name: str, *, force: bool = False) -> int:
    """``llmgw delete deployment NAME`` and ``llmgw delete node NAME [--force]``."""
    if kind == "node":
        result = await call(server, lambda client: client.delete_node(name, force=force))
    elif force:
        raise CliError("--force applies to 'delete node' only")
    else:
        result = await call(server, lambda client: client.delete_deployment(name))
    sys.stdout.write(f"{result.message}\n")
    return 0


# --- reads ---------------------------------------------------------------------------------


async def run_get_desired(server: str, kind: str, output: str) -> int:
    """``llmgw get deployments|profiles``."""

    async def read(client: ControlClient) -> tuple[list[Deployment], list[EngineProfile]]:
        if kind == "profiles":
            return [], await client.list_profiles()
        return list((await client.get_cluster()).deployments), []

    # A cluster's whole desired state, each deployment with the status the server computes
    # for it: 10,000 deployments took over 10 s to answer on a loaded 2-core machine.
    deployments, profiles = await call(server, read, Timeouts(call=30.0))
    items: Sequence[Deployment | EngineProfile] = profiles if kind == "profiles" else deployments
    if output == "json":
        sys.stdout.write(json.dumps({kind: [i.to_dict() for i in items]}, indent=2) + "\n")
        return 0
    rows = _profile_rows(profiles) if kind == "profiles" else deployment_rows(deployments)
    sys.stdout.write(render_table(rows) + "\n")
    return 0


def deployment_rows(deployments: Sequence[Deployment]) -> list[list[str]]:
    """One row per deployment, its status as the server computed it (``DeploymentStatus``);
    with AUTOSCALE (current→desired and the planner's reason) and the SIGNAL it acted on
    when some deployment has an autoscale policy."""
    rows = [["NAME", "PROFILE", "DESIRED", "READY", "UP-TO-DATE", "AVAILABLE", "REASON"]]
    scaled = any(d.autoscale is not None for d in deployments)
    if scaled:  # the autoscaler's columns, only where some deployment has a policy
        rows[0][-1:-1] = ["AUTOSCALE", "SIGNAL"]
    for d in deployments:
        status = d.status or DeploymentStatus(desired=d.replicas)
        counts = (status.desired, status.ready, status.up_to_date, status.available)
        row = [d.name, d.profile, *(str(n) for n in counts), status.reason]
        if scaled:
            signal = status.autoscale.signal if status.autoscale is not None else ""
            row[-1:-1] = [decision_cell(d), signal or "-"]
        rows.append(row)
    return rows


def _profile_rows(profiles: Sequence[EngineProfile]) -> list[list[str]]:
    rows = [["NAME", "ENGINE", "CLASS", "TP/PP/NODES", "MODEL", "FINGERPRINT"]]
    for p in profiles:
        shape = (
            f"threads {p.cpu_threads}" if p.gpu_class == CPU_CLASS else f"{p.tp}/{p.pp}/{p.nodes}"
        )
        rows.append([p.name, p.engine, p.gpu_class, shape, p.served_model_name, _fingerprint(p)])
    return rows


def _fingerprint(profile: EngineProfile) -> str:
    """The profile's fingerprint; "redacted" when the server hid its env values from this
    token (a fingerprint of the placeholders would match no running engine)."""
    if REDACTED in profile.env.values():
        return REDACTED
    return profile_fingerprint(profile)


# --- events --------------------------------------------------------------------------------


async def run_events(server: str, *, follow: bool) -> int:
    """``llmgw events [--follow]``: the audit log, then (following) new records as they come."""
    if not follow:
        cluster = await call(server, lambda client: client.get_cluster())
        rows = [["WHEN", "ACTOR", "ACTION", "TARGET", "RESULT"]]
        rows += [_event_cells(e) for e in cluster.events]
        sys.stdout.write(render_table(rows) + "\n")
        return 0
    await call(server, _follow)
    return 0


async def _follow(client: ControlClient) -> None:
    shown: set[bytes] = set()  # a fresh snapshot (after falling behind) repeats records
    stream = client.watch()
    try:
        async for event in stream:
            for record in _audits(event):
                key = bytes(record)
                if key not in shown:
                    shown.add(key)
                    sys.stdout.write("  ".join(map(escape, _event_cells(record))) + "\n")
                    sys.stdout.flush()
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _audits(event: WatchEvent) -> list[AuditEvent]:
    if event.snapshot is not None:
        return list(event.snapshot.events)
    return [event.audit] if event.audit is not None else []


def _event_cells(e: AuditEvent) -> list[str]:
    when = datetime.fromtimestamp(e.at_unix_ms / 1000, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [when, e.actor, e.action, e.target, e.result]
