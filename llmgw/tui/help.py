"""``?`` help and the ctrl+p palette, both generated from the action registry.

``help_sections`` lists the keys that work on the view on screen, by group: the
registry's ``ConsoleAction``s that the app allows there (its ``check_action``: scoped to
views, and no ``operate`` verb when read-only), so the help can neither miss a key nor
show one that does nothing. ``HelpScreen`` shows them. ``ConsoleCommands`` is the command
palette's provider: the same allowed actions by their words, plus "start a replica of
deployment X" for each deployment (one reaches a deployment scaled to zero this way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from llmgw.tui.registry import ACTIONS, ConsoleAction

__all__ = [
    "ActionHost",
    "ConsoleCommands",
    "HelpScreen",
    "HelpSection",
    "PaletteEntry",
    "help_body",
    "help_sections",
    "key_words",
    "palette_entries",
]

GROUPS = (("view", "views"), ("operate", "operate"), ("navigate", "navigate"),
          ("console", "console"))  # fmt: skip
"""Registry groups in the order the help shows them, with their headings."""

_KEY_WORDS = {
    "colon": ":", "slash": "/", "question_mark": "?", "escape": "esc", "space": "space",
    "down": "↓", "up": "↑", "left": "←", "right": "→",
}  # fmt: skip


def key_words(action: ConsoleAction) -> str:
    """The keys of ``action`` as a person types them: ``j ↓``, ``?``, ``ctrl+p``."""
    return " ".join(_KEY_WORDS.get(k, k) for k in action.keys.split(",") if k)


@dataclass(frozen=True, slots=True)
class HelpSection:
    """A group's heading and its (keys, words) lines."""

    heading: str
    lines: tuple[tuple[str, str], ...]


def help_sections(
    allowed: Callable[[ConsoleAction], bool], actions: Iterable[ConsoleAction] = ACTIONS
) -> list[HelpSection]:
    """The keyed actions ``allowed`` lets through, by group, in registry order."""
    keyed = [a for a in actions if a.keys and allowed(a)]
    sections = []
    for group, heading in GROUPS:
        lines = tuple((key_words(a), a.description) for a in keyed if a.group == group)
        if lines:
            sections.append(HelpSection(heading, lines))
    return sections


def _section_grid(sections: Sequence[HelpSection]) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True)
    for i, section in enumerate(sections):
        if i:
            grid.add_row("", "")
        grid.add_row(Text(section.heading, style="bold underline"), "")
        for keys, words in section.lines:
            grid.add_row(Text(keys), Text(words))
    return grid


def help_body(sections: Sequence[HelpSection]) -> RenderableType:
    """Two columns (views and operate | navigate and console) to fit 80×24."""
    left = [s for s in sections if s.heading in ("views", "operate")]
    right = [s for s in sections if s.heading not in ("views", "operate")]
    body = Table.grid(padding=(0, 4))
    body.add_row(_section_grid(left), _section_grid(right))
    return body


class HelpScreen(ModalScreen[None]):
    """The keys of one view; Esc, q or ? closes it."""

    BINDINGS = [
        Binding("escape", "close", "back"),
        Binding("q", "close", "back", show=False),
        Binding("question_mark", "close", "back", show=False),
    ]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 100%; max-width: 84; height: auto; max-height: 100%;
        border: round $accent; border-title-style: bold; padding: 0 1; background: $surface;
    }
    """

    def __init__(self, view_title: str, sections: Sequence[HelpSection]) -> None:
        super().__init__()
        self.view_title = view_title
        self.sections = tuple(sections)

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = f"Keys: {self.view_title}"
            box.border_subtitle = "esc: back"
            yield Static(help_body(self.sections), id="help-body")

    def action_close(self) -> None:
        self.dismiss(None)


# --- the command palette -------------------------------------------------------------------


@runtime_checkable
class ActionHost(Protocol):
    """What the palette asks of the app (``ConsoleApp``)."""

    def action_allowed(self, action: ConsoleAction) -> bool:
        """Whether ``action`` works on the view on screen (its keys would)."""
        ...

    def deployment_names(self) -> Sequence[str]:
        """The deployments the console knows, for "start a replica of deployment X"."""
        ...


@dataclass(frozen=True, slots=True)
class PaletteEntry:
    text: str  # what is matched and shown
    help: str
    action: str  # the App action string to run


def palette_entries(
    host: ActionHost, actions: Iterable[ConsoleAction] = ACTIONS
) -> list[PaletteEntry]:
    """The palette's commands: allowed actions, per deployment for ``start_deployment``."""
    entries: list[PaletteEntry] = []
    for action in actions:
        if not action.palette or not host.action_allowed(action):
            continue
        if action.name == "start_deployment":
            entries.extend(_start_entries(action, host.deployment_names()))
            continue
        text = action.words if action.group == "view" else action.description
        keys = f" (key {key_words(action)})" if action.keys else ""
        entries.append(PaletteEntry(text, action.words + keys, action.action))
    return entries


def _start_entries(action: ConsoleAction, deployments: Sequence[str]) -> Iterator[PaletteEntry]:
    for name in deployments:
        text = f"start a replica of deployment {name}"
        yield PaletteEntry(
            text, "one more replica, after a confirmation", f"{action.name}({name!r})"
        )


class ConsoleCommands(Provider):
    """The console's registry as command palette entries."""

    def _entries(self) -> list[PaletteEntry]:
        host = self.app
        return palette_entries(host) if isinstance(host, ActionHost) else []

    def _run(self, entry: PaletteEntry) -> Callable[[], object]:
        return partial(self.app.run_action, entry.action)

    async def discover(self) -> Hits:
        for entry in self._entries():
            yield DiscoveryHit(entry.text, self._run(entry), help=entry.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for entry in self._entries():
            score = matcher.match(entry.text)
            if score > 0:
                yield Hit(score, matcher.highlight(entry.text), self._run(entry), help=entry.help)
