"""The footer's key hints, fitted to the terminal's width (pure).

A hint is a key and its words (``d drain``). When the hints of the view on screen do not
fit on one line, whole hints are dropped, never cut: first the console's own (copy, pause,
quit, the palette), then navigation (filter, sort), then ``:`` view, then the view's verbs;
within one rank the last listed goes first. ``?`` help is never dropped: it lists every key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text

from llmgw.tui.registry import ConsoleAction

__all__ = ["SEPARATOR", "Hint", "fit_hints", "hint_rank", "hints_text"]

SEPARATOR = "  "
_ALWAYS = 0
_RANKS = {"operate": 1, "view": 2, "navigate": 3, "console": 4}


@dataclass(frozen=True, slots=True)
class Hint:
    key: str  # as shown: "d", "?", "space", "^p"
    words: str  # "drain"
    rank: int  # 0: never dropped; higher ranks are dropped first

    @property
    def width(self) -> int:
        return cell_len(self.key) + 1 + cell_len(self.words)


def hint_rank(action: ConsoleAction | None) -> int:
    """How soon a hint for ``action`` is dropped (``?`` help never)."""
    if action is None:
        return max(_RANKS.values()) + 1
    if action.name == "help":
        return _ALWAYS
    return _RANKS.get(action.group, max(_RANKS.values()) + 1)


def _width(hints: Sequence[Hint]) -> int:
    return sum(h.width for h in hints) + cell_len(SEPARATOR) * max(0, len(hints) - 1)


def fit_hints(hints: Sequence[Hint], width: int) -> list[Hint]:
    """The hints that fit in ``width`` cells, in their order, dropping whole ones."""
    kept = list(hints)
    by_drop_order = sorted(
        range(len(kept)), key=lambda i: (kept[i].rank, i), reverse=True
    )  # highest rank first, the last listed first within a rank
    dropped: set[int] = set()
    for index in by_drop_order:
        shown = [h for i, h in enumerate(kept) if i not in dropped]
        if _width(shown) <= width or kept[index].rank == _ALWAYS:
            break
        dropped.add(index)
    return [h for i, h in enumerate(kept) if i not in dropped]


def hints_text(hints: Sequence[Hint]) -> Text:
    """``? help  d drain``: each key bold, its words plain."""
    text = Text(no_wrap=True, overflow="crop")
    for i, hint in enumerate(hints):
        if i:
            text.append(SEPARATOR)
        text.append(hint.key, style="bold")
        text.append(f" {hint.words}")
    return text
