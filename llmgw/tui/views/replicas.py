"""Replicas and shards: state as glyph + word + colour, where each runs, for how long.

Per-replica in-flight requests, KV-cache usage and its engine's prefix-hit ratio come from the
gateway's figures (GetRouterStats, joined by replica id in the snapshot); – while the server does
not report them for a replica (no gateway, not polled yet).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

from rich.cells import cell_len
from rich.console import RenderableType

from llmgw.api.llmgw.v1 import ShardState
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.rows import ReplicaRow, ShardRow
from llmgw.tui.views.details import replica_detail, shard_detail
from llmgw.tui.views.table import Column, TableView
from llmgw.tui.widgets.cells import (
    NOT_REPORTED,
    age,
    percent,
    plain,
    shard_state_cell,
    shown,
)

__all__ = ["ReplicasView", "ShardsView"]

_STATE_ORDER = {s: i for i, s in enumerate(ShardState)}


def _id_order(key: str) -> tuple[Any, ...]:
    """``chat-10`` after ``chat-9``: digit runs compare as numbers."""
    head, _, tail = key.rpartition("-")
    number, _, rest = tail.partition(".")
    if number.isdigit():
        return (head, int(number), rest)
    return (key, 0, "")


def _age_since(since_ms: int, now_ms: int) -> str:
    return age((now_ms - since_ms) / 1000) if since_ms and now_ms >= since_ms else NOT_REPORTED


def _render_state(state: ShardState) -> RenderableType:
    return shard_state_cell(state)


def _render_profile(value: tuple[str, bool]) -> RenderableType:
    profile, out_of_date = value
    text = shown(profile, no_wrap=True, overflow="ellipsis")
    if out_of_date:
        text.append(" ↻old", style="bold yellow")
    return text


def _profile_width(value: tuple[str, bool]) -> int:
    profile, out_of_date = value
    return cell_len(profile) + (len(" ↻old") if out_of_date else 0)


def _render_optional_int(value: int | None) -> RenderableType:
    return plain(NOT_REPORTED, "dim") if value is None else plain(value)


def _render_ratio(value: float | None) -> RenderableType:
    return percent(None if value is None else value * 100)


class ReplicasView(TableView[ReplicaRow]):
    """``:replicas`` — every replica the server runs or plans."""

    TITLE = "Replicas"
    COLUMNS: ClassVar = (
        Column("replica", "REPLICA", 14, lambda r, now: r.replica_id,
               sort=lambda r: _id_order(r.replica_id), flex=True),
        Column("state", "STATE", 10, lambda r, now: r.state, _render_state,
               sort=lambda r: _STATE_ORDER[r.state]),
        Column("model", "MODEL", 12, lambda r, now: r.model, flex=True),
        Column("profile", "PROFILE", 14, lambda r, now: (r.profile, r.out_of_date),
               _render_profile, flex=True, measure=_profile_width),
        Column("nodes", "NODES", 10, lambda r, now: ",".join(r.nodes), flex=True),
        Column("gpus", "GPU", 3, lambda r, now: r.gpus),
        Column("up", "AGE", 4, lambda r, now: _age_since(r.since_ms, now),
               sort=lambda r: -r.since_ms, ticks=True),
        Column("in_flight", "INFL", 4, lambda r, now: r.in_flight, _render_optional_int),
        Column("kv", "KV", 4, lambda r, now: r.kv_usage, _render_ratio),
        Column("hit", "HIT", 4, lambda r, now: r.prefix_hit, _render_ratio),
    )  # fmt: skip

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, ReplicaRow]:
        return snapshot.replicas

    def order(self, key: str, row: ReplicaRow) -> Any:
        return _id_order(key)

    def replica_of(self, key: str) -> str | None:
        """The replica a row stands for (what ``d``, ``s`` and ``p`` act on)."""
        return key

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        row = snapshot.replicas.get(key)
        return None if row is None else replica_detail(row, snapshot)

    def described(self, key: str) -> tuple[str, str] | None:
        return ("replica", key)


def _gpus_of(row: ShardRow, now_ms: int) -> Hashable:
    return len(row.gpu_uuids)


class ShardsView(TableView[ShardRow]):
    """``:shards`` — every shard, on which node, in which state and why."""

    TITLE = "Shards"
    COLUMNS: ClassVar = (
        Column("shard", "SHARD", 14, lambda s, now: s.shard_id,
               sort=lambda s: _id_order(s.shard_id), flex=True),
        Column("state", "STATE", 10, lambda s, now: s.state, _render_state,
               sort=lambda s: _STATE_ORDER[s.state]),
        Column("node", "NODE", 12, lambda s, now: s.node_id, flex=True),
        Column("rank", "R", 1, lambda s, now: s.rank),
        Column("gpus", "GPU", 3, _gpus_of),
        Column("up", "AGE", 4, lambda s, now: _age_since(s.since_ms, now),
               sort=lambda s: -s.since_ms, ticks=True),
        Column("restarts", "RST", 3, lambda s, now: s.restarts),
        Column("reason", "REASON", 40, lambda s, now: s.reason, flex=True),
    )  # fmt: skip

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, ShardRow]:
        return snapshot.shards

    def order(self, key: str, row: ShardRow) -> Any:
        return _id_order(key)

    def replica_of(self, key: str) -> str | None:
        """A shard's row acts on its replica."""
        shard = self.snapshot.shards.get(key)
        return None if shard is None or not shard.replica_id else shard.replica_id

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        row = snapshot.shards.get(key)
        return None if row is None else shard_detail(row, snapshot)
