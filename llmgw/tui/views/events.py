"""Events: operator actions (the audit log) and the state changes the console saw, newest first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.console import RenderableType

from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import EventRow
from llmgw.tui.views.details import event_detail
from llmgw.tui.views.table import Column, TableView
from llmgw.tui.widgets.cells import clock, plain

__all__ = ["EventsView"]


_KIND_STYLE = {"audit": "bold", "node": "cyan", "shard": "", "replica": "magenta"}


def _render_kind(kind: str) -> RenderableType:
    return plain(kind, _KIND_STYLE.get(kind, ""))


def _render_result(result: str) -> RenderableType:
    style = "red" if result.startswith("refused") or "FAILED" in result else ""
    return plain(result, style)


class EventsView(TableView[EventRow]):
    """``:events`` — operator actions (the audit log) and state changes, newest first."""

    TITLE = "Events"
    COLUMNS: ClassVar = (
        Column("when", "TIME", 8, lambda e, now: clock(e.at_ms), sort=lambda e: e.seq),
        Column("kind", "KIND", 7, lambda e, now: e.kind, _render_kind),
        Column("action", "ACTION", 8, lambda e, now: e.action),
        Column("target", "TARGET", 14, lambda e, now: e.target, flex=True),
        Column("result", "RESULT", 60, lambda e, now: e.result, _render_result, flex=True),
        Column("actor", "ACTOR", 10, lambda e, now: e.actor, flex=True),
    )

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, EventRow]:
        return snapshot.events

    def order(self, key: str, row: EventRow) -> Any:
        return -row.seq

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        row = snapshot.events.get(key)
        return None if row is None else event_detail(row, snapshot)
