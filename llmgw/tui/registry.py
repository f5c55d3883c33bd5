"""The console's one action registry: keys, footer, help, palette and read-only all read it.

Each ``ConsoleAction`` names an App action (``action_<name>`` on ``ConsoleApp``), its keys,
its words, the views it applies to and whether it changes the cluster. ``bindings()`` makes
the App's BINDINGS from it; ``ConsoleApp.check_action`` hides an action outside its views
and every ``mutating`` one when the console is read-only (the client refuses them too). A
help screen or a command palette lists ``ACTIONS`` instead of keeping a list of its own.

The ``operate`` group holds the verbs that change the cluster (``mutating``): on a replica
(``d`` drain, ``s`` start, ``p`` reprofile) and on a node (``C`` cordon, ``U`` uncordon,
``D`` drain the node); each opens a confirmation naming its targets and impact
(``llmgw.tui.actions``, ``llmgw.tui.modals``). Beside them, ``l`` on a replica or a shard
opens its engine log, followed (``llmgw.tui.widgets.logpane``; it changes nothing, so
read-only keeps it), as in k9s: the cursor moves right with the arrow only.
``palette=False`` keeps an action out of the ctrl+p palette (cursor moves, the palette
itself); an action without keys is palette-only.

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
    """A view: its name (``:name`` jumps to it), title and other words ``:`` accepts, and
    the word the top bar shows for it (default: its name)."""

    name: str
    title: str
    aliases: tuple[str, ...] = ()
    crumb: str = ""

    @property
    def label(self) -> str:
        return self.crumb or self.name


VIEWS: tuple[ViewSpec, ...] = (
    ViewSpec("overview", "Overview", ("pulse", "home")),
    ViewSpec("nodes", "Nodes", ("node", "no", "topology", "topo", "gpus", "gpu")),
    ViewSpec("replicas", "Replicas", ("replica", "rs", "rep")),
    ViewSpec("shards", "Shards", ("shard", "sh")),
    ViewSpec("router", "Router", ("gateway", "rt")),
    ViewSpec("events", "Events", ("event", "ev", "audit", "log")),
    ViewSpec("deployments", "Deployments", ("deployment", "deploy", "dp"), crumb="deploy"),
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
    palette: bool = True  # offered by the ctrl+p command palette
    help: str = ""  # longer words for the palette's help line; default: description

    @property
    def name(self) -> str:
        """The action's method name without arguments: ``goto`` for ``goto('nodes')``."""
        return self.action.partition("(")[0]

    def applies_to(self, view: str) -> bool:
        return not self.views or view in self.views

    @property
    def words(self) -> str:
        """What the palette says it does (the help screen and footer use ``description``)."""
        return self.help or self.description


_TABLES = frozenset({"nodes", "replicas", "shards", "events", "deployments"})
_ON_REPLICAS = frozenset({"replicas", "shards"})  # a shard's row acts on its replica
_ON_NODES = frozenset({"nodes"})  # a GPU's row acts on its node

ACTIONS: tuple[ConsoleAction, ...] = (
    # priority: the keys typed right after ':' (a burst over ssh) must reach the prompt, so
    # it opens before the app hands them on to the widget that had the focus.
    ConsoleAction("prompt_view", "colon", "view", "view", key_display=":", priority=True,
                  palette=False, help="jump to a view by name (:nodes, :rs, :ev …)"),
    ConsoleAction("help", "question_mark", "help", "console", key_display="?",
                  help="the keys of this view"),
    *(
        ConsoleAction(f"goto('{v.name}')", str(i), v.title, "view", show=False,
                      help=f"go to {v.title.lower()}")
        for i, v in enumerate(VIEWS, start=1)
    ),
    # operate: the verbs of the view, first in the footer
    ConsoleAction("drain", "d", "drain", "operate", mutating=True, views=_ON_REPLICAS,
                  help="drain the selected replica (its deployment scales down by one)"),
    ConsoleAction("start", "s", "start", "operate", mutating=True, views=_ON_REPLICAS,
                  help="start one more replica of the selected replica's deployment"),
    ConsoleAction("reprofile", "p", "reprofile", "operate", mutating=True,
                  views=_ON_REPLICAS,
                  help="move the selected replica's deployment to another stored profile"),
    ConsoleAction("logs", "l", "logs", "operate", views=_ON_REPLICAS, show=False,
                  help="follow the selected replica's (rank-0 shard's) or shard's engine output"),
    ConsoleAction("start_deployment", "", "start a replica of a deployment", "operate",
                  mutating=True, show=False),
    ConsoleAction("cordon", "C", "cordon", "operate", mutating=True, views=_ON_NODES,
                  help="cordon the selected node: nothing new is placed on it"),
    ConsoleAction("uncordon", "U", "uncordon", "operate", mutating=True, views=_ON_NODES,
                  help="uncordon the selected node"),
    ConsoleAction("drain_node", "D", "drain node", "operate", mutating=True, views=_ON_NODES,
                  help="cordon the selected node and move its replicas elsewhere"),
    # navigate
    ConsoleAction("filter", "slash", "filter", "navigate", views=_TABLES, key_display="/",
                  help="filter the rows by their text (!text: rows without it)"),
    ConsoleAction("escape", "escape", "back", "navigate", show=False, palette=False,
                  help="clear the filter; close a detail or a dialog"),
    ConsoleAction("detail", "enter", "detail", "navigate", views=_TABLES, show=False,
                  help="open the selected row's detail"),
    ConsoleAction("cursor('down')", "j,down", "down", "navigate", views=_TABLES, show=False,
                  palette=False),
    ConsoleAction("cursor('up')", "k,up", "up", "navigate", views=_TABLES, show=False,
                  palette=False),
    ConsoleAction("cursor('left')", "h,left", "left", "navigate", views=_TABLES, show=False,
                  palette=False),
    ConsoleAction("cursor('right')", "right", "right", "navigate", views=_TABLES,
                  show=False, palette=False),  # l is logs, as in k9s
    ConsoleAction("cursor('top')", "g,home", "top", "navigate", views=_TABLES, show=False,
                  palette=False),
    ConsoleAction("cursor('bottom')", "G,end", "bottom", "navigate", views=_TABLES,
                  show=False, palette=False),
    ConsoleAction("sort", "o", "sort", "navigate", views=_TABLES,
                  help="order by the next column (again: descending, then the default)"),
    # console
    ConsoleAction("copy_id", "c", "copy id", "console", views=_TABLES,
                  help="copy the selected row's id to the clipboard"),
    ConsoleAction("pause", "space", "pause", "console", key_display="space",
                  help="pause or resume updates"),
    ConsoleAction("command_palette", "ctrl+p", "palette", "console", key_display="^p",
                  show=False, priority=True, palette=False),
    ConsoleAction("quit", "q,ctrl+q", "quit", "console"),
)  # fmt: skip


def action_named(name: str, actions: Iterable[ConsoleAction] = ACTIONS) -> ConsoleAction | None:
    """The registered action whose method is ``name`` (the first, for ``goto``)."""
    return next((a for a in actions if a.name == name), None)


def bindings(actions: Sequence[ConsoleAction] = ACTIONS) -> list[Binding]:
    """App BINDINGS for every action that has keys: one per key, the footer showing the
    first key only (``q``, not ``ctrl+q`` too)."""
    return [
        Binding(
            key,
            a.action,
            a.description,
            show=a.show and i == 0,
            key_display=a.key_display if i == 0 else None,
            priority=a.priority,
        )
        for a in actions
        for i, key in enumerate(a.keys.split(",") if a.keys else ())
    ]
