"""The overview (the cluster's pulse) and the router view: numbers and sparklines.

Both redraw only when what they show changed (their frozen summaries compare by value).
Router figures come from ``GetRouterStats``; while the server does not give them, both
views say so in words, with the server's reason, instead of drawing zeros. A server that
gives the detailed figures adds each tier's hit share, the reuse ratios (available and
captured out of the routed prompt tokens, delivered out of the engines' prompt tokens) and
a row per replica (in flight, request rate, its engine's own prefix-cache hit ratio); the
router view lists the last decisions, newest first, under a warning when the precise tier's
predictions drift from what the engines report cached (``llmgw.tui.routes``).
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Label, Sparkline, Static

from llmgw.tui.model import ConsoleSnapshot, ReplicaLoad, RouterStatus, RouterView
from llmgw.tui.routes import RoutesView
from llmgw.tui.summary import Overview, summarize
from llmgw.tui.widgets.cells import NOT_REPORTED, GiB, age, percent, shard_state_cell, shown

__all__ = ["OverviewView", "RouterPanel", "overview_text", "router_text"]

NOT_ON_API = "not reported by the server yet"


def _grid() -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    return grid


def overview_text(
    overview: Overview, router: RouterView, server: str, leader: str = ""
) -> RenderableType:
    grid = _grid()
    grid.add_row("server", Text(server))
    if leader:  # which server of the database leads (issue #17)
        grid.add_row("leader", Text(leader))
    grid.add_row(
        "nodes",
        Text(
            f"{overview.nodes_ready}/{overview.nodes_total} ready, "
            f"{overview.nodes_cordoned} cordoned, {overview.nodes_not_ready} not ready"
        ),
    )
    grid.add_row("GPUs", _gpus(overview))
    grid.add_row("replicas", _replicas(overview))
    grid.add_row(
        "",
        Text(
            f"{overview.replicas_out_of_date} out of date, {overview.shards_total} shards, "
            f"{overview.deployments} deployments"
        ),  # fmt: skip
    )
    for label, line in _shortfalls(overview):
        grid.add_row(label, line)
    grid.add_row("requests", _requests(router))
    if router.routes.warning:  # the precise tier's check drifts (llmgw.tui.routes)
        grid.add_row("routing", Text(f"⚠ DRIFT {router.routes.warning}", style="bold yellow"))
    return grid


SHORT_SHOWN = 3
"""Deployments short of desired that the overview names (the rest are counted)."""


def _shortfalls(overview: Overview) -> list[tuple[str, Text]]:
    """One line per deployment short of desired: ready/desired (and how many of those are
    on its profile as it is now, when not all) and the server's reason."""
    lines = []
    for i, short in enumerate(overview.short[:SHORT_SHOWN]):
        words = f"{short.deployment} {short.ready}/{short.desired} ready"
        if short.available != short.ready:
            words += f", {short.available} up to date"
        text = shown(words, "bold red")
        if short.reason:
            text.append_text(shown(f": {short.reason}"))
        lines.append(("short" if i == 0 else "", text))
    if len(overview.short) > SHORT_SHOWN:
        more = len(overview.short) - SHORT_SHOWN
        lines.append(("", Text(f"and {more} more (:deployments)")))
    return lines


def _gpus(overview: Overview) -> Text:
    counts = overview.gpus
    slices = f" · MIG slices {counts.slices_used}/{counts.slices} used" if counts.slices else ""
    text = Text(f"{counts.gpus_used}/{counts.gpus} used{slices}, ")
    text.append(
        f"{overview.gpus_unhealthy} unhealthy", "bold red" if overview.gpus_unhealthy else ""
    )
    text.append(f", {overview.gpus_unknown_health} health unknown; memory ")
    text.append(
        f"{overview.gpu_memory_used_bytes / GiB:.0f}/{overview.gpu_memory_total_bytes / GiB:.0f}"
        " GiB, util "
    )
    text.append_text(percent(overview.mean_utilization_pct))
    return text


def _replicas(overview: Overview) -> Text:
    text = Text(f"{overview.replicas_total}: ")
    shown = [(s, n) for s, n in overview.replicas_by_state if n]
    for i, (state, count) in enumerate(shown):
        if i:
            text.append("  ")
        text.append_text(shard_state_cell(state))
        text.append(f" {count}")
    return text


def _requests(router: RouterView) -> Text:
    if router.status is RouterStatus.UNKNOWN:
        return Text("router stats: asking…", style="dim")
    if router.status is RouterStatus.UNAVAILABLE:
        return Text(router.reason or "no router stats", style="dim")
    rate = NOT_REPORTED if router.request_rate is None else f"{router.request_rate:.1f}/s"
    what = "prefix hits" if router.detailed else "routed by cached prefix"
    share = (
        "no requests in the window"
        if router.prefix_share is None
        else f"{router.prefix_share:.0%} {what}"
    )
    return Text(f"{rate} over {router.window_s:.0f}s, {share}; {router.decisions} decisions")


def router_text(router: RouterView) -> RenderableType:
    if router.status is not RouterStatus.AVAILABLE:
        return Group(_requests(router), Text(""), _missing())
    if router.detailed:
        parts = (_tier_table(router), Text(""), _reuse(router), Text(""), _replica_table(router))
        warning = _drift_warning(router.routes)
        decisions = (Text(""), decision_table(router.routes))
        return Group(*warning, _requests(router), Text(""), *parts, *decisions)
    tiers = Table("TIER", "DECISIONS", "RATE", box=None, padding=(0, 2))
    rates = dict(router.tier_rates)
    for tier, total in router.by_tier:
        tiers.add_row(Text(tier), str(total), f"{rates.get(tier, 0.0):.1f}/s")
    if not router.by_tier:
        tiers.add_row(Text("(no decisions yet)", style="dim"), "", "")
    return Group(_requests(router), Text(""), tiers, Text(""), _missing())


def _share(value: float | None) -> Text:
    return percent(None if value is None else 100 * value)


def _tier_table(router: RouterView) -> Table:
    tiers = Table("TIER", "DECISIONS", "RATE", "HIT", box=None, padding=(0, 2))
    for tier in router.tiers:
        tiers.add_row(
            Text(tier.tier), str(tier.decisions), f"{tier.rate:.1f}/s", _share(tier.hit_share)
        )
    if not router.tiers:
        tiers.add_row(Text("(no decisions yet)", style="dim"), "", "", "")
    return tiers


def _reuse(router: RouterView) -> Table:
    grid = _grid()
    idle = Text("no prompts in the window", style="dim")

    def line(value: float | None, out_of: str, extra: str = "") -> Text:
        return idle if value is None else Text(f"{value:.0%} of {out_of}{extra}")

    captured = router.captured_of_available
    extra = "" if captured is None else f" ({captured:.0%} of available)"
    grid.add_row("reuse available", line(router.available_share, "routed prompt tokens"))
    grid.add_row("reuse captured", line(router.captured_share, "routed prompt tokens", extra))
    grid.add_row("reuse delivered", line(router.delivered_share, "engine prompt tokens"))
    return grid


def _replica_table(router: RouterView) -> Table:
    table = Table("REPLICA", "IN-FLIGHT", "REQ/S", "DELIVERED HIT", "KV", box=None, padding=(0, 2))
    for row in router.replicas:
        table.add_row(*_replica_cells(row))
    if not router.replicas:
        table.add_row(Text("(no replicas in the routing table)", style="dim"), "", "", "", "")
    return table


def _drift_warning(routes: RoutesView) -> tuple[Text, ...]:
    if not routes.warning:
        return ()
    return (Text(f"⚠ DRIFT {routes.warning}", style="bold yellow"), Text(""))


def decision_table(routes: RoutesView) -> Table:
    """The last decisions, newest first: age, tier, replica, match, cached, candidates, why."""
    columns = ("AGO", "TIER", "REPLICA", "MATCHED", "CACHED", "CANDIDATES", "REASON")
    table = Table(
        *columns, box=None, padding=(0, 1), title="recent decisions", title_justify="left"
    )
    check = (
        "" if routes.drift is None else f"reuse check: drift {routes.drift:.0%} ({routes.source})"
    )
    table.caption, table.caption_justify = check or None, "left"
    for row in routes.recent:
        ago = age((routes.at_ms - row.at_ms) / 1000) if row.at_ms and routes.at_ms else "-"
        table.add_row(
            Text(ago),
            Text(row.tier),
            Text(row.replica_id, no_wrap=True, overflow="ellipsis"),
            Text(row.matched or "-"),
            Text("-" if row.cached_tokens is None else str(row.cached_tokens)),
            Text(row.candidates or "-", overflow="ellipsis"),
            Text(row.reason),
        )
    if not routes.recent:
        table.add_row(Text("(no decisions yet)", style="dim"), *[""] * 6)
    return table


def _replica_cells(row: ReplicaLoad) -> tuple[Text, ...]:
    rate = NOT_REPORTED if row.request_rate is None else f"{row.request_rate:.1f}/s"
    kv = f"{row.kv_capacity_tokens:,} tok" if row.kv_capacity_tokens else NOT_REPORTED
    return (
        Text(row.replica_id, no_wrap=True, overflow="ellipsis"),
        Text(str(row.in_flight)),
        Text(rate),
        _share(row.delivered_hit_ratio),
        Text(kv, style="" if row.kv_capacity_tokens else "dim"),
    )


def _missing() -> Table:
    grid = _grid()
    grid.add_row("reuse available", Text(NOT_ON_API, style="dim"))
    grid.add_row("reuse captured", Text(NOT_ON_API, style="dim"))
    grid.add_row("reuse delivered", Text(NOT_ON_API, style="dim"))
    grid.add_row("per-replica load", Text(NOT_ON_API, style="dim"))
    return grid


class _Pulse(Widget):
    """A text block and two sparklines (request rate, prefix-routed share)."""

    DEFAULT_CSS = """
    _Pulse { height: 1fr; }
    _Pulse Sparkline { height: 2; margin: 0 1; }
    _Pulse Label { margin: 1 1 0 1; }
    _Pulse .pulse-text { padding: 0 1; }
    """

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id)
        self._shown: object = None
        self._text = Static(classes="pulse-text", id=f"{id}-text")
        self._rate = Sparkline([], id=f"{id}-rate")
        self._share = Sparkline([], id=f"{id}-share")
        self._rate_label = Label(id=f"{id}-rate-label")
        self._share_label = Label(id=f"{id}-share-label")
        self._snapshot = ConsoleSnapshot.empty()

    @property
    def snapshot(self) -> ConsoleSnapshot:
        return self._snapshot

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield self._text
            yield self._rate_label
            yield self._rate
            yield self._share_label
            yield self._share

    def show(self, snapshot: ConsoleSnapshot) -> None:
        self._snapshot = snapshot
        key, body = self.render_body(snapshot)
        if key == self._shown:
            return
        self._shown = key
        self._text.update(body)
        self._series(self._rate, self._rate_label, "requests/s", snapshot.router.rate_series)
        share = snapshot.router.share_series
        title = "prefix-hit rate" if snapshot.router.detailed else "share routed by a cached prefix"
        self._series(self._share, self._share_label, title, share)

    @staticmethod
    def _series(line: Sparkline, label: Label, title: str, data: tuple[float, ...]) -> None:
        """A sparkline of ``data``, or words saying there is none (never a fake flat line)."""
        line.display = len(data) > 1
        line.data = list(data)
        label.update(title if len(data) > 1 else f"{title}: no samples yet")

    def render_body(self, snapshot: ConsoleSnapshot) -> tuple[object, RenderableType]:
        raise NotImplementedError


class OverviewView(_Pulse):
    """``:overview`` — nodes, GPUs, replicas by state, request rate, prefix-routed share."""

    TITLE = "Overview"

    def __init__(self, *, id: str, server: str) -> None:
        super().__init__(id=id)
        self._server = server

    def render_body(self, snapshot: ConsoleSnapshot) -> tuple[object, RenderableType]:
        overview = summarize(snapshot)
        shown = overview_text(overview, snapshot.router, self._server, snapshot.leader)
        return (overview, snapshot.router, snapshot.leader), shown


class RouterPanel(_Pulse):
    """``:router`` — decisions by tier, reuse, per-replica load, rates (sparklines)."""

    TITLE = "Router"

    def render_body(self, snapshot: ConsoleSnapshot) -> tuple[object, RenderableType]:
        return snapshot.router, router_text(snapshot.router)
