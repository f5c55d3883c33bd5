"""Deployments: desired against actual, as the server computed it (``DeploymentStatus``).

READY is ``ready/desired`` (kubectl's), UPDATED the replicas on the deployment's profile
as it is now, AVAIL those of them ready; REASON the server's one line saying what keeps
the deployment short (no place for a replica, a failed one, a node gone, starting, a
rollout). AUTOSCALE is the autoscaler's current→desired count and the planner's reason
(``advise`` before it when it only reports; "-" for a fixed count) and SIGNAL what it
acted on. Enter opens the counts, the autoscaler (policy, decision in words, signal, the
window's figures) and the three conditions with how long each has held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from llmgw.tui.autoscale import AutoscaleRow
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import ConditionRow, DeploymentRow
from llmgw.tui.views.table import Column, TableView
from llmgw.tui.widgets.cells import NOT_REPORTED, age, plain, shown

__all__ = ["DeploymentsView", "deployment_detail"]


def _render_ready(value: tuple[int, int]) -> RenderableType:
    ready, desired = value
    glyph, style = ("✓", "green") if ready >= desired else ("✗", "bold red")
    return plain(f"{glyph} {ready}/{desired}", style)


def _render_count(value: tuple[int, int]) -> RenderableType:
    count, desired = value
    return plain(count, "" if count >= desired else "yellow")


def _render_reason(value: tuple[str, bool]) -> RenderableType:
    reason, failing = value
    return shown(reason, "red" if failing else "yellow", no_wrap=True, overflow="ellipsis")


def _autoscale(row: DeploymentRow) -> tuple[str, bool]:
    """The autoscaler's cell and whether it wants another count ("-": a fixed count)."""
    scaler = row.autoscale
    return ("-", False) if scaler is None else (scaler.cell, scaler.moving)


def _render_autoscale(value: tuple[str, bool]) -> RenderableType:
    cell, moving = value
    return shown(cell, "cyan" if moving else "", no_wrap=True, overflow="ellipsis")


def _signal(row: DeploymentRow) -> str:
    return row.autoscale.signal or "-" if row.autoscale is not None else "-"


def _failing(row: DeploymentRow) -> bool:
    return any(c.type == "ReplicaFailure" and c.status for c in row.conditions)


class DeploymentsView(TableView[DeploymentRow]):
    """``:deployments`` — each deployment's desired, ready, updated and available replicas."""

    TITLE = "Deployments"
    COLUMNS: ClassVar = (
        Column("name", "NAME", 10, lambda d, now: d.name),
        Column("profile", "PROFILE", 12, lambda d, now: d.profile),
        Column("ready", "READY", 7, lambda d, now: (d.ready, d.replicas), _render_ready,
               sort=lambda d: d.ready - d.replicas),
        Column("updated", "UPDATED", 7, lambda d, now: (d.up_to_date, d.replicas),
               _render_count, sort=lambda d: d.up_to_date - d.replicas),
        Column("available", "AVAIL", 5, lambda d, now: (d.available, d.replicas),
               _render_count, sort=lambda d: d.available - d.replicas),
        Column("autoscale", "AUTOSCALE", 18, lambda d, now: _autoscale(d), _render_autoscale),
        Column("signal", "SIGNAL", 20, lambda d, now: _signal(d)),
        Column("reason", "REASON", 96, lambda d, now: (d.reason, _failing(d)), _render_reason),
    )  # fmt: skip

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, DeploymentRow]:
        return snapshot.deployments

    def order(self, key: str, row: DeploymentRow) -> Any:
        """Short ones first, then by name."""
        return (not row.short, key)

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        row = snapshot.deployments.get(key)
        return None if row is None else deployment_detail(row, snapshot.taken_ms)


def deployment_detail(row: DeploymentRow, now_ms: int) -> tuple[str, RenderableType]:
    """The counts, the reason and each condition with how long it has held."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    grid.add_row("deployment", shown(f"{row.name}, profile {row.profile}"))
    counts = (
        f"{row.replicas} desired, {row.ready} ready, {row.up_to_date} up to date, "
        f"{row.available} available, {row.starting} starting, {row.failed} failed, "
        f"{row.unplaceable} with no place"
    )
    grid.add_row("replicas", shown(counts))
    grid.add_row("reason", shown(row.reason or NOT_REPORTED))
    if row.autoscale is not None:
        _autoscale_detail(grid, row.autoscale, now_ms)
    for condition in row.conditions:
        grid.add_row(condition.type, _condition(condition, now_ms))
    return f"deployment {row.name}", grid


def _autoscale_detail(grid: Table, scaler: AutoscaleRow, now_ms: int) -> None:
    """The policy; then the planner's count, its reason in words, the signal it acted on
    and the window's figures (or that it has not decided yet)."""
    grid.add_row("autoscale", shown(scaler.policy))
    if not scaler.decided:
        grid.add_row("autoscaler", shown("no decision yet"))
        return
    decided = f"{scaler.current} → {scaler.desired} ({scaler.reason or 'hold'})"
    if scaler.decided_ms:
        decided += f", decided {age((now_ms - scaler.decided_ms) / 1000)} ago"
    grid.add_row("autoscaler", shown(decided))
    grid.add_row("why", shown(scaler.message or NOT_REPORTED))
    grid.add_row("signal", shown(scaler.signal or NOT_REPORTED))
    grid.add_row("window", shown(scaler.window))
    if scaler.gpu_budget:
        grid.add_row("gpu budget", shown(f"{scaler.gpu_budget} GPUs in the pool"))


def _condition(condition: ConditionRow, now_ms: int) -> Text:
    good = condition.status != (condition.type == "ReplicaFailure")
    text = plain("True" if condition.status else "False", "green" if good else "bold red")
    held = age((now_ms - condition.since_ms) / 1000) if condition.since_ms else NOT_REPORTED
    text.append(f" {condition.reason}, for {held}")
    if condition.message:
        text.append_text(shown(f": {condition.message}"))
    return text
