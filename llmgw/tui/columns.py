"""Column widths that fit the terminal (pure): fixed columns keep theirs, flexible ones
(names and ids) take what their content needs and give way only when the screen is too
narrow.

Each column has a ``base`` width; a flexible one also has the width its widest cell (or its
label) ``wants``. When everything wanted fits in the width available, every flexible column
gets what it wants. When it does not, the widest flexible column gives up a cell at a time
(its cells end in an ellipsis) until the table fits, none below its ``floor``. Fixed columns
(states, numbers, ages) never shrink: what they show must be whole; a table still too wide
with every flexible column at its floor scrolls sideways.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CELL_PADDING", "ColumnFit", "fit_columns"]

CELL_PADDING = 2
"""Cells a table spends around each column (DataTable's ``cell_padding`` of 1, each side)."""


@dataclass(frozen=True, slots=True)
class ColumnFit:
    base: int  # a fixed column's width
    wants: int = 0  # a flexible column's: its widest cell or its label
    flex: bool = False
    floor: int = 0  # a flexible column is never narrower than this


def fit_columns(columns: Sequence[ColumnFit], available: int) -> list[int]:
    """Each column's width within ``available`` cells (padding included)."""
    widths = [max(c.wants, c.floor) if c.flex else c.base for c in columns]
    excess = sum(widths) + CELL_PADDING * len(widths) - available
    while excess > 0:
        shrinkable = [i for i, c in enumerate(columns) if c.flex and widths[i] > c.floor]
        if not shrinkable:
            break
        widest = max(shrinkable, key=lambda i: (widths[i], -i))
        widths[widest] -= 1
        excess -= 1
    return widths
