"""``/`` filters the view on screen: a substring of the row's text, ``!`` inverts it.

``parse_filter`` reads what was typed (``chat``, ``!READY``; case does not matter) into a
``RowFilter``; ``RowFilter.matches`` tests a row's text. A row's text is its cells as the
table shows them, joined by spaces (``TableView.row_text``), so what an operator reads is
what the filter finds: ``READY``, ``⊘ CORDONED``, a node id, a profile. ``RowTexts`` keeps
each row's text while the row object is unchanged (rows are frozen and replaced when they
change), so a filter on a busy view renders only the rows that changed since the last update.

``FilterPrompt`` is the one-line input ``/`` opens; it filters as it is typed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.binding import Binding
from textual.message import Message
from textual.widgets import Input

__all__ = ["FilterPrompt", "RowFilter", "RowTexts", "parse_filter"]

INVERT = "!"


@dataclass(frozen=True, slots=True)
class RowFilter:
    """What ``/`` was given: rows whose text holds ``needle`` (or, inverted, does not)."""

    needle: str  # lower case, never empty
    inverted: bool = False

    @property
    def text(self) -> str:
        """As an operator would type it again: ``chat`` or ``!chat``."""
        return (INVERT if self.inverted else "") + self.needle

    def matches(self, row_text: str) -> bool:
        return (self.needle in row_text.lower()) is not self.inverted


def parse_filter(typed: str) -> RowFilter | None:
    """The filter ``typed`` means; None (show every row) when it has no words."""
    text = typed.strip()
    inverted = text.startswith(INVERT)
    needle = text.removeprefix(INVERT).strip().lower() if inverted else text.lower()
    return RowFilter(needle, inverted) if needle else None


class RowTexts:
    """Each row's text, computed once per row object.

    Two generations: a lookup during a pass (one ``show`` of a view) moves the entry into
    the current generation; ``next_pass`` drops what the last pass did not ask for (rows
    replaced or removed), so the cache stays the size of the view.
    """

    def __init__(self) -> None:
        self._current: dict[int, tuple[object, str]] = {}
        self._previous: dict[int, tuple[object, str]] = {}

    def __len__(self) -> int:
        return len(self._current)

    def next_pass(self) -> None:
        self._previous, self._current = self._current, {}

    def text(self, row: object, compute: Callable[[], str]) -> str:
        key = id(row)
        entry = self._current.get(key) or self._previous.get(key)
        if entry is None or entry[0] is not row:  # an id reused by a newer object
            entry = (row, compute())
        self._current[key] = entry
        return entry[1]


class FilterPrompt(Input):
    """The ``/`` input under the view: each change filters; Enter keeps it; Esc clears it."""

    BINDINGS = [Binding("escape", "dismiss", "clear", show=False)]

    class Dismissed(Message):
        """Esc: the filter is to be cleared and the prompt closed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(placeholder="filter: text in the row; !text: rows without it", id=id)

    def action_dismiss(self) -> None:
        self.post_message(self.Dismissed())
