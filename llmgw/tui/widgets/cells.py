"""How values look in a cell: state as glyph + word + colour, never colour alone.

Colours are the 16 ANSI names (green, yellow, red, …) so a 16-colour terminal shows them as
meant, and every state also has its own glyph and word, so ``NO_COLOR`` loses nothing.
Every function returns a ``rich.text.Text`` built from plain strings (never markup: an id
with brackets stays an id), with control characters escaped (:func:`shown`: a hostname with a
newline or an escape sequence prints as ``\\n``/``\\x1b``, never drives the terminal).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Final

from rich.console import RenderableType
from rich.text import Text

from llmgw.api.llmgw.v1 import Health, NodeState, ShardState
from llmgw.printable import escape

__all__ = [
    "NOT_REPORTED",
    "LazyCell",
    "age",
    "bar",
    "clock",
    "gib",
    "health_cell",
    "node_state_cell",
    "percent",
    "plain",
    "ranges",
    "shown",
    "shard_state_cell",
    "temperature",
]

NOT_REPORTED: Final = "–"
"""What a cell shows for a value the server does not report (never a made-up zero)."""

SHARD_STATES: Final[dict[ShardState, tuple[str, str]]] = {
    ShardState.PENDING: ("○", "yellow"),
    ShardState.STARTING: ("◔", "yellow"),
    ShardState.LOADING: ("◑", "cyan"),
    ShardState.READY: ("●", "green"),
    ShardState.DRAINING: ("▽", "magenta"),
    ShardState.STOPPED: ("■", "bright_black"),
    ShardState.FAILED: ("✗", "bold red"),
}
NODE_STATES: Final[dict[NodeState, tuple[str, str, str]]] = {
    NodeState.READY: ("●", "READY", "green"),
    NodeState.NOT_READY: ("✗", "NOT_READY", "bold red"),
    NodeState.CORDONED: ("⊘", "CORDONED", "yellow"),
}
HEALTH: Final[dict[Health, tuple[str, str, str]]] = {
    Health.HEALTHY: ("✓", "ok", "green"),
    Health.UNHEALTHY: ("✗", "FAIL", "bold red"),
    Health.UNKNOWN: ("?", "unknown", "yellow"),
}
_EIGHTHS: Final = " ▏▎▍▌▋▊▉█"
GiB: Final = 1 << 30


class LazyCell:
    """A cell drawn only when it is on screen: ``render(value)`` runs in ``__rich__``.

    A table of 1,800 rows shows 50; building a ``Text`` for each changed cell of the
    others (thousands per heartbeat round) would be most of an update's cost.
    """

    __slots__ = ("render", "value")

    def __init__(self, render: Callable[[Any], RenderableType], value: Any) -> None:
        self.render = render
        self.value = value

    def __rich__(self) -> RenderableType:
        return self.render(self.value)

    def __repr__(self) -> str:
        return f"LazyCell({self.value!r})"


def shown(value: object, style: str = "", **options: Any) -> Text:
    """``value`` as plain text, its control characters escaped (``llmgw.printable``)."""
    return Text(escape(str(value)), style=style, **options)


def plain(value: object, style: str = "") -> Text:
    return shown(value, style, no_wrap=True, overflow="ellipsis")


def shard_state_cell(state: ShardState) -> Text:
    glyph, style = SHARD_STATES.get(state, ("?", "bold red"))
    return Text(f"{glyph} {state.name}", style=style, no_wrap=True)


def node_state_cell(state: NodeState, cordoned: bool = False) -> Text:
    glyph, word, style = NODE_STATES.get(state, ("?", "UNKNOWN", "bold red"))
    if cordoned and state is NodeState.READY:  # a cordoned node reports READY + cordoned
        glyph, word, style = NODE_STATES[NodeState.CORDONED]
    return Text(f"{glyph} {word}", style=style, no_wrap=True)


def health_cell(health: Health) -> Text:
    glyph, word, style = HEALTH.get(health, HEALTH[Health.UNKNOWN])
    return Text(f"{glyph} {word}", style=style, no_wrap=True)


def bar(fraction: float, width: int) -> str:
    """A horizontal bar of ``width`` cells in eighths, for 0 ≤ fraction ≤ 1."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


def percent(value: float | None, *, width: int = 0) -> Text:
    """``87%`` (with a bar of ``width`` cells before it when width > 0); – when unknown."""
    if value is None:
        return plain(NOT_REPORTED, "dim")
    text = Text(no_wrap=True)
    if width:
        text.append(bar(value / 100, width), style="cyan")
        text.append(" ")
    text.append(f"{value:3.0f}%")
    return text


def gib(used: int, total: int) -> Text:
    """``45/80G``; total alone when nothing is used."""
    return plain(f"{used / GiB:.0f}/{total / GiB:.0f}G")


def temperature(celsius: int) -> Text:
    if not celsius:
        return plain(NOT_REPORTED, "dim")
    style = "bold red" if celsius >= 85 else "yellow" if celsius >= 75 else ""
    return plain(f"{celsius}°", style)


def age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``: the largest whole unit."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def clock(unix_ms: int) -> str:
    """Local ``HH:MM:SS`` of a Unix-ms time (today's events); – for 0."""
    if not unix_ms:
        return NOT_REPORTED
    return datetime.fromtimestamp(unix_ms / 1000).strftime("%H:%M:%S")


def ranges(values: Iterable[int]) -> str:
    """[0, 1, 2, 5] → ``0-2,5``."""
    out: list[str] = []
    ordered = sorted(set(values))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)
