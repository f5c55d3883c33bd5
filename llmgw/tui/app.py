"""``ConsoleApp``: the Textual console over one snapshot feed.

One worker runs the ``Feed`` (``WatchSession`` against a server; a fake in benchmarks) and
hands over frozen snapshots; the app applies the newest one to the view on screen only
(the others catch up with one keyed diff when they are shown), at most once per message
loop turn, so keys are never stuck behind a backlog of updates. ``space`` pauses: the
worker keeps following, the screen stays still until it is resumed.

Keys, the footer and what read-only hides come from ``llmgw.tui.registry``; an action is
an ``action_<name>`` method here. The badge says LIVE / STALE 12s / RECONNECTING #n, and
while the link is not LIVE the views are dimmed; the app never exits on a disconnect.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import ContentSwitcher, Footer, Input, Static

from llmgw.client import ControlClient
from llmgw.tui.model import ConsoleSnapshot
from llmgw.tui.registry import VIEWS, action_named, bindings, resolve_view
from llmgw.tui.stream import Feed, LinkStatus
from llmgw.tui.views.events import EventsView
from llmgw.tui.views.pulse import OverviewView, RouterPanel
from llmgw.tui.views.replicas import ReplicasView, ShardsView
from llmgw.tui.views.table import TableView
from llmgw.tui.views.topology import TopologyView
from llmgw.tui.widgets.badge import LinkBadge
from llmgw.tui.widgets.detail import DetailScreen
from llmgw.tui.widgets.prompt import JumpPrompt

__all__ = ["GC_THRESHOLDS", "ConsoleApp", "ConsoleView", "pick_theme"]

GC_THRESHOLDS = (50_000, 20, 100)
"""``gc.set_threshold`` for a console process (``llmgw console`` sets it; a library must not).

With Python's default (700, 10, 10), a busy fleet's updates (thousands of rows replaced per
second) promote short-lived rows into the old generation and a full collection runs every
second or two, stalling keys for 0.1–0.3 s on a loaded machine. Collecting the young
generation every 50,000 allocations instead lets replaced rows die by reference counting
first; scripts/bench_console.py saw no full collection in 12 s of its heaviest load."""

ConsoleView = TableView[Any] | OverviewView | RouterPanel


_NOT_WHILE_TYPING = frozenset({"prompt_view"})


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
        }
        self._badge = LinkBadge(id="badge")
        self._crumbs_bar = Static(self._crumbs(), id="crumbs")
        self._switcher = ContentSwitcher(id="views", initial=self.current_view)
        self._prompt = JumpPrompt(id="jump")
        self._link_note = Static(id="link-note")  # why the link is down, while it is
        with Horizontal(id="topbar"):
            yield self._crumbs_bar
            yield self._badge
        yield self._link_note
        with self._switcher:
            yield from self._views.values()
        yield self._prompt
        yield Footer()

    def on_mount(self) -> None:
        self._prompt.display = False
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
        return "  ".join(
            f"[reverse] {v.name} [/]" if v.name == self.current_view else v.name for v in VIEWS
        )

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
            self._link_note.update(Text(status.error, no_wrap=True, overflow="ellipsis"))
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
        if self.focused is self._prompt:
            return action not in _NOT_WHILE_TYPING  # ':' typed in the prompt is a character
        spec = action_named(action)
        if spec is None:
            return True
        if spec.mutating and self.read_only:
            return False
        return spec.applies_to(self.current_view)

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
        if content is not None:
            self.push_screen(DetailScreen(*content))

    def action_copy_id(self) -> None:
        view = self.view()
        selected = view.selected_id() if isinstance(view, TableView) else None
        if selected is None:
            self.notify("nothing selected to copy", severity="warning")
            return
        self.copy_to_clipboard(selected)
        self.notify(f"copied {selected}")

    def action_sort(self) -> None:
        view = self.view()
        if isinstance(view, TableView):
            self.notify(view.cycle_sort(), timeout=2)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._refresh_badge()
        if not self.paused:
            self._apply_latest()
