"""``llmgw get KIND --watch``: the table, then a row for each change, as ``kubectl get -w``.

It follows the server's ``Watch`` stream: the first snapshot prints the whole table; after
that each event is applied to a copy of the cluster (:func:`apply_event`) and every row
that is new or differs from the one printed last for the same name (the first column) is
appended, aligned to the first table's columns; an object that is gone prints its name and
``<removed>``. A fresh snapshot (after the client fell behind) prints only what changed.
It runs until Ctrl-C (exit 130) or the stream ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

import betterproto2

from llmgw.api.llmgw.v1 import Cluster, WatchEvent
from llmgw.cli.apply import deployment_rows
from llmgw.cli.rpc import call
from llmgw.client import ControlClient
from llmgw.printable import escape

__all__ = ["WATCHED", "RowPrinter", "apply_event", "run_watch"]

WATCHED = ("nodes", "replicas", "shards", "deployments")

RowsOf = Callable[[Cluster], list[list[str]]]


def _node_id(node: Any) -> str:
    return str(node.info.node_id) if node.info is not None else ""


_LISTS: dict[str, tuple[str, Callable[[Any], str]]] = {
    # an event's field (and its ``_removed`` twin) → the cluster's list, and an item's name
    "node": ("nodes", _node_id),
    "shard": ("shards", lambda s: str(s.shard_id)),
    "replica": ("replicas", lambda r: str(r.replica_id)),
    "deployment": ("deployments", lambda d: str(d.name)),
}


def apply_event(cluster: Cluster | None, event: WatchEvent) -> Cluster | None:
    """``cluster`` with ``event`` applied (None until the first snapshot)."""
    if event.snapshot is not None:
        return event.snapshot
    field, value = betterproto2.which_one_of(event, "event")
    kind = field.removesuffix("_removed")
    if cluster is None or kind not in _LISTS:
        return cluster  # telemetry and audit records change no table row here
    attr, name_of = _LISTS[kind]
    items: list[Any] = list(getattr(cluster, attr))
    if field.endswith("_removed"):
        setattr(cluster, attr, [i for i in items if name_of(i) != value])
        return cluster
    name = name_of(value)
    at = next((i for i, item in enumerate(items) if name_of(item) == name), None)
    if at is None:
        items.append(value)
    else:
        items[at] = value
    setattr(cluster, attr, items)
    return cluster


class RowPrinter:
    """Prints the first table whole, then the rows that changed; the whole table again
    when its columns change (``get deployments`` gains the autoscaler's when a deployment
    with a policy appears)."""

    def __init__(self, rows_of: RowsOf, out: TextIO) -> None:
        self._rows_of = rows_of
        self._out = out
        self._shown: dict[str, list[str]] | None = None  # name → the row printed last
        self._header: list[str] = []
        self._widths: list[int] = []

    def show(self, cluster: Cluster) -> None:
        header, *rows = [[escape(c) for c in row] for row in self._rows_of(cluster)]
        now = {row[0]: row for row in rows}
        if self._shown is None or header != self._header:
            self._header = header
            self._widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
            lines = [header, *rows]
        else:
            lines = [row for name, row in now.items() if self._shown.get(name) != row]
            lines += [[name, "<removed>"] for name in self._shown if name not in now]
        self._shown = now
        for line in lines:
            cells = [c.ljust(w) for c, w in zip(line, self._widths, strict=False)]
            self._out.write("  ".join(cells).rstrip() + "\n")
        if lines:
            self._out.flush()


async def run_watch(server: str, kind: str, rows_of: RowsOf | None) -> int:
    """Follow the server's Watch stream, printing ``kind``'s table and then its changes."""

    async def follow(client: ControlClient) -> None:
        table = rows_of or _deployment_table
        printer = RowPrinter(table, sys.stdout)
        cluster: Cluster | None = None
        stream = client.watch()
        try:
            async for event in stream:
                cluster = apply_event(cluster, event)
                if cluster is not None:
                    printer.show(cluster)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    await call(server, follow)
    return 0


def _deployment_table(cluster: Cluster) -> list[list[str]]:
    return deployment_rows(cluster.deployments)
