"""The console's one action registry: keys, footer, help, palette and read-only all read it.

Each ``ConsoleAction`` names an App action (``action_<name>`` on ``ConsoleApp``), its keys,
its words, the views it applies to and whether it changes the cluster. ``bindings()`` makes
the App's BINDINGS from it; ``ConsoleApp.check_action`` hides an action outside its views
and every ``mutating`` one when the console is read-only (the client refuses them too). A
help screen or a command palette lists ``ACTIONS`` instead of keeping a list of its own.

Views and what ``:`` accepts for them (k9s grammar) are here too: ``resolve_view``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from textual.binding import Binding

__all__ = [
    "ACTIONS",
    "VIEWS",
    "ConsoleAction",
    "ViewSpec",
    "action_named",
    "bindings",
    "resolve_view",
]


@dataclass(frozen=True, slots=True)
class ViewSpec:
    """A view: its name (``:name`` jumps to it), title and other words ``:`` accepts."""

    name: str
    title: str
    aliases: tuple[str, ...] = ()


VIEWS: tuple[ViewSpec, ...] = (
    ViewSpec("overview", "Overview", ("pulse", "home")),
    ViewSpec("nodes", "Nodes", ("node", "no", "topology", "topo", "gpus", "gpu")),
    ViewSpec("replicas", "Replicas", ("replica", "rs", "rep")),
    ViewSpec("shards", "Shards", ("shard", "sh")),
    ViewSpec("router", "Router", ("gateway", "rt")),
    ViewSpec("events", "Events", ("event", "ev", "audit", "log")),
)


def resolve_view(text: str) -> str | None:
    """The view ``:text`` means: a name, an alias, or an unambiguous prefix of a name."""
    word = text.strip().lstrip(":").strip().lower()
    if not word:
        return None
    for view in VIEWS:
        if word == view.name or word in view.aliases:
            return view.name
    matches = [v.name for v in VIEWS if v.name.startswith(word)]
    return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True, slots=True)
class ConsoleAction:
    """One thing an operator can do, however it is invoked."""

    action: str  # the App action, with arguments: "goto('nodes')", "pause"
    keys: str  # Textual key names, comma-separated; "" for palette-only
    description: str  # short words for the footer and help
    group: str = "console"  # "view", "navigate", "console", "operate" (help sections)
    mutating: bool = False  # sends a mutating RPC: hidden with --read-only
    views: frozenset[str] = frozenset()  # where it applies; empty: everywhere
    show: bool = True  # in the footer
    key_display: str | None = None
    priority: bool = False  # the app handles the key before the focused widget sees it

    @property
    def name(self) -> str:
        """The action's method name without arguments: ``goto`` for ``goto('nodes')``."""
        return self.action.partition("(")[0]

    def applies_to(self, view: str) -> bool:
        return not self.views or view in self.views


_TABLES = frozenset({"nodes", "replicas", "shards", "events"})

ACTIONS: tuple[ConsoleAction, ...] = (
    # priority: the keys typed right after ':' (a burst over ssh) must reach the prompt, so
    # it opens before the app hands them on to the widget that had the focus.
    ConsoleAction("prompt_view", "colon", "view", "view", key_display=":", priority=True),
    *(
        ConsoleAction(f"goto('{v.name}')", str(i), v.title, "view", show=False)
        for i, v in enumerate(VIEWS, start=1)
    ),
    ConsoleAction("detail", "enter", "detail", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('down')", "j", "down", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('up')", "k", "up", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('left')", "h", "left", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('right')", "l", "right", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('top')", "g", "top", "navigate", views=_TABLES, show=False),
    ConsoleAction("cursor('bottom')", "G", "bottom", "navigate", views=_TABLES, show=False),
    ConsoleAction("sort", "o", "sort", "navigate", views=_TABLES),
    ConsoleAction("copy_id", "c", "copy id", "console", views=_TABLES),
    ConsoleAction("pause", "space", "pause", "console", key_display="space"),
    ConsoleAction("quit", "q", "quit", "console"),
)


def action_named(name: str, actions: Iterable[ConsoleAction] = ACTIONS) -> ConsoleAction | None:
    """The registered action whose method is ``name`` (the first, for ``goto``)."""
    return next((a for a in actions if a.name == name), None)


def bindings(actions: Sequence[ConsoleAction] = ACTIONS) -> list[Binding]:
    """App BINDINGS for every action that has keys."""
    return [
        Binding(
            a.keys,
            a.action,
            a.description,
            show=a.show,
            key_display=a.key_display,
            priority=a.priority,
        )
        for a in actions
        if a.keys
    ]
