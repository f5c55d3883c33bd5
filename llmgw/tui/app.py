"""``ConsoleApp``: the Textual console over one snapshot feed.

One worker runs the ``Feed`` (``WatchSession`` against a server; a fake in benchmarks) and
hands over frozen snapshots; the app applies the newest one to the view on screen only
(the others catch up with one keyed diff when they are shown), at most once per message
loop turn, so keys are never stuck behind a backlog of updates. ``space`` pauses: the
worker keeps following, the screen stays still until it is resumed.

Keys, the footer (``KeyFooter``: hints fitted to the width, whole ones dropped), ``?``
help, the ctrl+p palette (``llmgw.tui.help``) and what read-only hides come from
``llmgw.tui.registry``; an action is an ``action_<name>`` method here. The
operator verbs plan an ``Operation`` against the selected row's view snapshot (the whole
model, not the filtered rows; ``llmgw.tui.actions``) and confirm it in a modal before
sending it (``llmgw.tui.modals``). ``/`` filters the view on screen (``llmgw.tui.filter``);
Esc clears it. The badge says LIVE / STALE 12s / RECONNECTING #n, and while the link is not
LIVE the views are dimmed; the app never exits on a disconnect.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from rich.markup import escape
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.command import Provider
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Input, Static

from llmgw.client import ClientError, ControlClient
from llmgw.tui.actions import (
    ActionUnavailable,
    DrainPlacement,
    Operation,
    drain_placement,
    plan_cordon,
    plan_drain,
    plan_drain_node,
    plan_reprofile,
    plan_start,
    plan_uncordon,
    profile_choice,
    same_model,
)
from llmgw.tui.filter import FilterPrompt, parse_filter
from llmgw.tui.help import ConsoleCommands, HelpScreen, help_sections
from llmgw.tui.modals import Choice, ChoiceScreen, choose, propose, unavailable
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.registry import VIEWS, ConsoleAction, action_named, bindings, resolve_view
from llmgw.tui.stream import Feed, LinkStatus
from llmgw.tui.views.deployments import DeploymentsView
from llmgw.tui.views.details import history_section
from llmgw.tui.views.events import EventsView
from llmgw.tui.views.pulse import OverviewView, RouterPanel
from llmgw.tui.views.replicas import ReplicasView, ShardsView
from llmgw.tui.views.table import TableView
from llmgw.tui.views.topology import TopologyView
from llmgw.tui.widgets.badge import LinkBadge
from llmgw.tui.widgets.cells import shown
from llmgw.tui.widgets.detail import DetailScreen
from llmgw.tui.widgets.footer import KeyFooter
from llmgw.tui.widgets.logpane import TAIL, LogPane
from llmgw.tui.widgets.prompt import JumpPrompt

__all__ = ["GC_THRESHOLDS", "ConsoleApp", "ConsoleView", "pick_theme"]

GC_THRESHOLDS = (50_000, 20, 100)
"""``gc.set_threshold`` for a console process (``llmgw console`` sets it; a library must not).

With Python's default (700, 10, 10), a busy fleet's updates (thousands of rows replaced per
second) promote short-lived rows into the old generation and a full collection runs every
second or two, stalling keys for 0.1–0.3 s on a loaded machine. Collecting the young
generation every 50,000 allocations instead lets replaced rows die by reference counting
first; bench/console.py saw no full collection in 12 s of its heaviest load."""

ConsoleView = TableView[Any] | OverviewView | RouterPanel


_NOT_WHILE_TYPING = frozenset({"prompt_view"})
# Priority keys reach the app over a modal (a detail, a confirmation, the palette): these
# would open something under it.
_NOT_OVER_MODALS = frozenset({"prompt_view", "command_palette"})


def pick_theme(environ: Mapping[str, str]) -> str:
    """``ansi-dark`` (the terminal's own 16 colours) unless it says it has more."""
    term = environ.get("TERM", "")
    if environ.get("COLORTERM", "") in ("truecolor", "24bit") or "256color" in term:
        return "textual-dark"
    if environ.get("TEXTUAL_COLOR_SYSTEM", "") in ("256", "truecolor"):
        return "textual-dark"
    return "ansi-dark"


class ConsoleApp(App[None]):
    """The operator console. ``client`` is for actions (None: a console that only shows)."""

    CSS_PATH = "app.tcss"
    TITLE = "llmgw console"
    BINDINGS: ClassVar[list[BindingType]] = list(bindings())
    COMMANDS: ClassVar[set[type[Provider] | Callable[[], type[Provider]]]] = {ConsoleCommands}

    def __init__(
        self,
        feed: Feed,
        *,
        client: ControlClient | None = None,
        server: str = "",
        read_only: bool = False,
        view: str = "overview",
        theme: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.feed = feed
        self.client = client
        self.server = server
        self.read_only = read_only or (client is not None and client.read_only)
        self.current_view = view
        self.clock = clock
        self.status = LinkStatus()
        self.paused = False
        self.latest = ConsoleSnapshot.empty()  # the newest from the feed
        self.displayed = self.latest  # what the views show (older while paused)
        self.apply_seconds: deque[float] = deque(maxlen=10_000)  # per applied snapshot
        self._apply_pending = False
        self._views_ready = False  # mounted: widgets can be queried
        self.theme = theme or pick_theme(os.environ)

    # --- layout ------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        # Kept by reference, not queried: App.query_one looks at the screen on top, which
        # is a detail page while one is open.
        self._views: dict[str, ConsoleView] = {
            "overview": OverviewView(id="overview", server=self.server),
            "nodes": TopologyView(id="nodes"),
            "replicas": ReplicasView(id="replicas"),
            "shards": ShardsView(id="shards"),
            "router": RouterPanel(id="router"),
            "events": EventsView(id="events"),
            "deployments": DeploymentsView(id="deployments"),
        }
        self._badge = LinkBadge(id="badge")
        self._crumbs_bar = Static(self._crumbs(), id="crumbs")
        self._switcher = ContentSwitcher(id="views", initial=self.current_view)
        self._prompt = JumpPrompt(id="jump")
        self._filter = FilterPrompt(id="filter")
        self._link_note = Static(id="link-note")  # why the link is down, while it is
        with Horizontal(id="topbar"):
            yield self._crumbs_bar
            yield self._badge
        yield self._link_note
        with self._switcher:
            yield from self._views.values()
        yield self._filter
        yield self._prompt
        yield KeyFooter(id="footer")

    def on_mount(self) -> None:
        self._prompt.display = False
        self._filter.display = False
        self._switcher.add_class("-stale")
        self.set_interval(1.0, self._refresh_badge, name="badge")
        self.run_worker(self.feed.run(self), name="watch", group="watch", exclusive=True)
        self._focus_view()
        self._views_ready = True
        self.status_changed(self.status)

    def view(self, name: str | None = None) -> ConsoleView:
        """The view called ``name`` (default: the one on screen)."""
        return self._views[name or self.current_view]

    def _crumbs(self) -> str:
        crumbs = "  ".join(
            f"[reverse] {v.label} [/]" if v.name == self.current_view else v.label for v in VIEWS
        )
        view = self._views[self.current_view]
        row_filter = view.row_filter if isinstance(view, TableView) else None
        return crumbs if row_filter is None else f"{crumbs}  [bold]/{escape(row_filter.text)}[/]"

    def _focus_view(self) -> None:
        view = self.view()
        self._focus_now(view.table if isinstance(view, TableView) else None)

    def _focus_now(self, widget: Widget | None) -> None:
        """Focus ``widget`` before the next queued key is handled (``Widget.focus`` waits
        for the queue: keys typed in a burst, as over ssh, would go to the old focus)."""
        self.screen.set_focus(widget, scroll_visible=False)

    # --- the feed (FeedSink) -----------------------------------------------------------

    def snapshot_ready(self, snapshot: ConsoleSnapshot) -> None:
        self.latest = snapshot
        if not self.paused and not self._apply_pending:
            self._apply_pending = True
            self.call_later(self._apply_latest)

    def status_changed(self, status: LinkStatus) -> None:
        self.status = status
        if self._views_ready:
            self._switcher.set_class(not status.live, "-stale")
            self._link_note.display = not status.live and bool(status.error)
            self._link_note.update(shown(status.error, no_wrap=True, overflow="ellipsis"))
            self._refresh_badge()

    def _apply_latest(self) -> None:
        self._apply_pending = False
        if self.paused:
            return
        started = time.perf_counter()
        self.displayed = self.latest
        self.view().show(self.displayed)
        self.apply_seconds.append(time.perf_counter() - started)

    def _refresh_badge(self) -> None:
        self._badge.show_status(self.status, self.clock(), paused=self.paused)

    # --- actions -----------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in _NOT_WHILE_TYPING and self.focused in (self._prompt, self._filter):
            return False  # ':' typed in a prompt is a character
        if action in _NOT_OVER_MODALS and self.screen.is_modal:
            return False
        spec = action_named(action)
        return True if spec is None else self.action_allowed(spec)

    def action_allowed(self, action: ConsoleAction) -> bool:
        """Whether ``action`` works on the view on screen: hidden outside its views, and
        every mutating one when read-only (the footer, help and palette ask this too)."""
        if action.mutating and self.read_only:
            return False
        return action.applies_to(self.current_view)

    def action_goto(self, name: str) -> None:
        if name not in {v.name for v in VIEWS}:
            self.notify(f"no view named {name!r}", severity="error")
            return
        self.current_view = name
        self._switcher.current = name
        self._crumbs_bar.update(self._crumbs())
        self.view().show(self.displayed)
        self._focus_view()
        self.refresh_bindings()

    def action_prompt_view(self) -> None:
        prompt = self._prompt
        prompt.value = ""
        prompt.display = True
        self._focus_now(prompt)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input is self._filter:
            event.stop()
            self._apply_filter(event.value)
            self._close_filter()
            return
        if not isinstance(event.input, JumpPrompt):
            return
        event.stop()
        name = resolve_view(event.value)
        self._close_prompt()
        if name is None:
            self.notify(f"no view {event.value.strip()!r}", severity="error")
        else:
            self.action_goto(name)

    def on_jump_prompt_dismissed(self, event: JumpPrompt.Dismissed) -> None:
        self._close_prompt()

    def _close_prompt(self) -> None:
        self._prompt.display = False
        self._focus_view()

    def action_cursor(self, direction: str) -> None:
        view = self.view()
        if not isinstance(view, TableView):
            return
        table = view.table
        moves: dict[str, Callable[[], None]] = {
            "down": table.action_cursor_down,
            "up": table.action_cursor_up,
            "left": table.action_cursor_left,
            "right": table.action_cursor_right,
            "top": lambda: table.move_cursor(row=0),
            "bottom": lambda: table.move_cursor(row=max(0, table.row_count - 1)),
        }
        moves[direction]()

    def action_detail(self) -> None:
        view = self.view()
        key = view.selected_key() if isinstance(view, TableView) else None
        if not isinstance(view, TableView) or key is None:
            return
        content = view.detail(key, view.snapshot)
        if content is None:
            return
        screen = DetailScreen(*content)
        self.push_screen(screen)
        described = view.described(key)
        if described is not None and self.client is not None:
            work = self._show_history(screen, self.client, *described)
            self.run_worker(work, group="detail", exclusive=True)

    async def _show_history(
        self, screen: DetailScreen, client: ControlClient, kind: str, name: str
    ) -> None:
        """Add the object's recent events (``Describe``) under its open detail."""
        try:
            description = await client.describe(kind, name)
        except ClientError as exc:
            screen.add_section(Text(f"Recent events: not available ({exc})"))
            return
        screen.add_section(history_section(description.events))

    def action_copy_id(self) -> None:
        view = self.view()
        selected = view.selected_id() if isinstance(view, TableView) else None
        if selected is None:
            self.notify("nothing selected to copy", severity="warning")
            return
        self.copy_to_clipboard(selected)
        self.notify(f"copied {selected}", markup=False)

    def action_sort(self) -> None:
        view = self.view()
        if isinstance(view, TableView):
            self.notify(view.cycle_sort(), timeout=2)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._refresh_badge()
        if not self.paused:
            self._apply_latest()

    # --- / filter, ? help, Esc ------------------------------------------------------------

    def action_filter(self) -> None:
        view = self.view()
        if not isinstance(view, TableView):
            return
        self._filter.value = view.row_filter.text if view.row_filter else ""
        self._filter.display = True
        self._focus_now(self._filter)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input is self._filter:  # filters as it is typed
            event.stop()
            self._apply_filter(event.value)

    def on_filter_prompt_dismissed(self, event: FilterPrompt.Dismissed) -> None:
        self._apply_filter("")
        self._close_filter()

    def _apply_filter(self, typed: str) -> None:
        view = self.view()
        if isinstance(view, TableView):
            view.set_filter(parse_filter(typed))
            self._crumbs_bar.update(self._crumbs())

    def _close_filter(self) -> None:
        self._filter.display = False
        self._focus_view()

    def action_escape(self) -> None:
        """Esc on a view: clear its filter (a detail, dialog or prompt closes itself)."""
        view = self.view()
        if isinstance(view, TableView) and view.row_filter is not None:
            self._apply_filter("")

    def action_help(self) -> None:
        title = next(v.title for v in VIEWS if v.name == self.current_view)
        self.push_screen(HelpScreen(title, help_sections(self.action_allowed)))

    def deployment_names(self) -> list[str]:
        """Every deployment the console knows of (stored, or named by a replica)."""
        shown = self.displayed
        return sorted(set(shown.deployments) | {r.deployment for r in shown.replicas.values()})

    # --- operator verbs -------------------------------------------------------------------

    def _propose(self, plan: Callable[[], Operation]) -> None:
        try:
            operation = plan()
        except ActionUnavailable as exc:
            unavailable(self, exc)
            return
        propose(self, operation, self.client)

    def _selected_replica(self) -> tuple[ConsoleSnapshot, str] | None:
        view = self.view()
        replica = None
        if isinstance(view, ReplicasView | ShardsView):
            key = view.selected_key()
            replica = view.replica_of(key) if key is not None else None
        if replica is None:
            self.notify("select a replica first", severity="warning")
            return None
        return view.snapshot, replica

    def _selected_node(self) -> tuple[ConsoleSnapshot, str] | None:
        view = self.view()
        key = view.selected_key() if isinstance(view, TopologyView) else None
        if key is None or not isinstance(view, TopologyView):
            self.notify("select a node first", severity="warning")
            return None
        return view.snapshot, view.node_of(key)

    def action_logs(self) -> None:
        """``l``: follow the selected replica's or shard's engine output (Esc closes)."""
        view = self.view()
        key = view.selected_key() if isinstance(view, ReplicasView | ShardsView) else None
        if key is None:
            self.notify("select a replica or a shard first", severity="warning")
            return
        if (client := self.client) is None:
            self.notify("no server to read logs from", severity="error")
            return
        self.push_screen(LogPane(key, lambda: client.stream_logs(key, follow=True, tail=TAIL)))

    def action_drain(self) -> None:
        if (selected := self._selected_replica()) is not None:
            self._propose(lambda: plan_drain(*selected))

    def action_start(self) -> None:
        """``s``: one more replica of the selected replica's deployment; with nothing
        selected, of a deployment chosen from a list."""
        view = self.view()
        if isinstance(view, TableView) and view.selected_key() is None:
            self._choose_deployment()
            return
        if (selected := self._selected_replica()) is None:
            return
        snapshot, replica = selected
        row = snapshot.replicas.get(replica)
        if row is None:
            unavailable(self, ActionUnavailable(f"replica {replica} is not in the cluster"))
            return
        self._propose(lambda: plan_start(snapshot, row.deployment))

    def action_start_deployment(self, name: str) -> None:
        self._propose(lambda: plan_start(self.displayed, name))

    def _choose_deployment(self) -> None:
        names = self.deployment_names()
        if not names:
            self.notify("no deployment to start a replica of", severity="warning")
            return
        screen = ChoiceScreen(
            "Start a replica of", "Which deployment?", [Choice(n, n) for n in names]
        )
        choose(self, screen, self.action_start_deployment)

    def action_reprofile(self) -> None:
        if (selected := self._selected_replica()) is None:
            return
        snapshot, replica = selected
        row = snapshot.replicas.get(replica)
        if row is None:
            unavailable(self, ActionUnavailable(f"replica {replica} is not in the cluster"))
            return
        self.run_worker(self._choose_profile(row.deployment, row.profile), group="operate")

    async def _choose_profile(self, deployment: str, current: str) -> None:
        """The stored profiles of the model the deployment serves (ListProfiles), the one in
        use marked, highlighted and not choosable; then confirm."""
        if self.client is None:
            self.notify("this console has no connection to send actions on", severity="error")
            return
        try:
            stored = [profile_choice(p) for p in await self.client.list_profiles()]
        except ClientError as exc:
            self.notify(str(exc), title="cannot list profiles", severity="error", markup=False)
            return
        profiles = same_model(stored, current)
        by_name = {p.name: p for p in profiles}
        if not by_name.keys() - {current}:
            self.notify(
                f"no stored profile of the same model besides {current}",
                severity="warning",
                markup=False,
            )
            return
        choices = [
            Choice(p.name, f"● {p.name} (in use): {p.summary}" if p.name == current
                   else f"  {p.name}: {p.summary}", disabled=p.name == current)
            for p in profiles
        ]  # fmt: skip
        model = by_name[current].model if current in by_name else ""
        note = (
            f"Deployment {deployment} uses profile {current}"
            + (f" (model {model})" if model else "")
            + ". Its replicas are replaced one at a time with the profile chosen; "
            "you confirm next. Only profiles of the same model are listed."
        )
        screen = ChoiceScreen(f"Reprofile deployment {deployment}", note, choices, current)
        choose(self, screen, lambda name: self._propose(
            lambda: plan_reprofile(self.displayed, deployment, current, by_name[name])
        ))  # fmt: skip

    def action_cordon(self) -> None:
        if (selected := self._selected_node()) is not None:
            self._propose(lambda: plan_cordon(*selected))

    def action_uncordon(self) -> None:
        if (selected := self._selected_node()) is not None:
            self._propose(lambda: plan_uncordon(*selected))

    def action_drain_node(self) -> None:
        """``D``: the confirmation says where the server's placement would move each
        replica (a dry run of the drain, asked first)."""
        if (selected := self._selected_node()) is not None:
            self.run_worker(self._drain_node(*selected), group="operate")

    async def _drain_node(self, snapshot: ConsoleSnapshot, node_id: str) -> None:
        placement = DrainPlacement(unknown="this console has no connection to the server")
        if self.client is not None:
            try:
                answer = await self.client.drain_node(node_id, dry_run=True)
            except ClientError as exc:
                placement = DrainPlacement(unknown=f"the server's dry run failed: {exc}")
            else:
                placement = drain_placement(answer.message)
        self._propose(lambda: plan_drain_node(snapshot, node_id, placement))
