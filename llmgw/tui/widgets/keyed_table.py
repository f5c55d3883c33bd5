"""A DataTable whose rows are addressed by id: selection by key, order by a key function,
and batched adds, removals and cell updates (one re-index or repaint per batch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import zip_longest
from typing import Any

from rich.console import RenderableType
from textual._two_way_dict import TwoWayDict
from textual.widgets import DataTable
from textual.widgets.data_table import (
    CellDoesNotExist,
    CellKey,
    ColumnKey,
    DuplicateKey,
    Row,
    RowDoesNotExist,
    RowKey,
)

__all__ = ["KeyedTable"]


class KeyedTable(DataTable[RenderableType]):
    """``DataTable`` with row-cursor defaults and batched calls keyed by row id.

    Every column must be added with a fixed width (``add_column(label, width=N, key=…)``):
    ``append_rows`` does not measure cells.
    """

    def __init__(self, *, id: str | None = None, fixed_columns: int = 1) -> None:
        super().__init__(
            id=id,
            cursor_type="row",
            zebra_stripes=False,
            show_row_labels=False,
            fixed_columns=fixed_columns,
        )

    def set_widths(self, widths: Mapping[str, int]) -> bool:
        """Give the columns (by key) these fixed widths; whether any changed (then the
        table is laid out again and redrawn)."""
        changed = False
        for key, width in widths.items():
            column = self.columns.get(ColumnKey(key))
            if column is not None and column.width != width:
                column.width = width
                changed = True
        if changed:
            self._clear_caches()
            self._require_update_dimensions = True
            self.refresh()
        return changed

    def selected_key(self) -> str | None:
        """The id of the row under the cursor, None when the table is empty."""
        if not self.row_count or not self.is_valid_row_index(self.cursor_row):
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return row_key.value

    def select_key(self, key: str, *, scroll: bool = True) -> bool:
        """Put the cursor on the row ``key``; False when there is none."""
        try:
            index = self.get_row_index(key)
        except RowDoesNotExist:
            return False
        if index != self.cursor_row:
            self.move_cursor(row=index, animate=False, scroll=scroll)
        return True

    def append_rows(self, rows: Sequence[tuple[str, Sequence[RenderableType]]]) -> int:
        """Add many rows, ``(row id, cells)``, at the bottom; how many.

        ``add_row`` re-validates the cursor and recomputes the column order for each row,
        and queues the row to have every cell measured for column widths (rendering it,
        the costlier part). This adds them as ``add_row``
        does (textual 8.2.8, pinned) and does the rest once; rows are one line without a
        label and every column has a fixed width (``add_column(width=…)``: the only way
        this table is used), so nothing needs measuring. A duplicate id raises
        ``DuplicateKey`` before anything is added.
        """
        keys = [RowKey(row_id) for row_id, _ in rows]
        taken = [k.value for k in keys if k in self._data]
        if taken or len(set(keys)) != len(keys):
            raise DuplicateKey(f"Row keys {taken or 'repeated'!r} already exist.")
        if not rows:
            return 0
        was_empty = self.row_count == 0
        columns = [column.key for column in self.ordered_columns]
        for row_key, (_, cells) in zip(keys, rows, strict=True):
            if len(cells) > len(columns):
                raise ValueError("More values provided than there are columns.")
            self._row_locations[row_key] = self.row_count
            self._data[row_key] = dict(zip_longest(columns, cells))
            self.rows[row_key] = Row(row_key, 1, None, False)
        self._require_update_dimensions = True
        self.cursor_coordinate = self.cursor_coordinate
        if was_empty and self.columns and self.show_cursor and self.cursor_type != "none":
            self._highlight_cursor()
        self._update_count += 1
        self.check_idle()
        return len(keys)

    def remove_rows(self, row_ids: Iterable[str]) -> int:
        """Remove many rows with one re-index; how many.

        ``remove_row`` re-indexes every remaining row for each row it removes, so removing
        a thousand rows of a thousand costs a million steps (the event log turning over in
        one update took 0.5–0.7 s). This removes them as ``remove_row`` does (textual 8.2.8,
        pinned) and re-indexes once; an unknown id raises ``RowDoesNotExist``.
        """
        doomed = {RowKey(row_id) for row_id in row_ids}
        missing = [k.value for k in doomed if k not in self._data]
        if missing:
            raise RowDoesNotExist(f"Row keys {sorted(map(str, missing))!r} are not valid.")
        if not doomed:
            return 0
        locations = self._row_locations
        kept = sorted((locations.get(k), k) for k in locations if k not in doomed)
        self._row_locations = TwoWayDict({k: i for i, (_, k) in enumerate(kept)})
        for row_key in doomed:
            for column_key in self._data[row_key]:
                self._updated_cells.discard(CellKey(row_key, column_key))
            del self.rows[row_key]
            del self._data[row_key]
        self._require_update_dimensions = True
        self.cursor_coordinate = self.cursor_coordinate
        self.hover_coordinate = self.hover_coordinate
        self._update_count += 1
        self.refresh(layout=True)
        self.check_idle()
        return len(doomed)

    def update_cells(self, cells: Iterable[tuple[str, str, RenderableType]]) -> int:
        """Set many cells, ``(row id, column key, value)``, with one repaint; how many.

        ``update_cell`` repaints the widget for each cell, which for a heartbeat of a
        1,600-GPU fleet (4,800 cells) is most of an update. This writes each cell as
        ``update_cell`` does (textual 8.2.8, pinned; column widths stay as they are) and
        repaints once; unknown rows or columns raise ``CellDoesNotExist``
        as ``update_cell`` does.
        """
        count = 0
        data = self._data
        columns = {key.value: key for key in self.columns}
        row_id, row = None, None
        for cell_row, column_id, value in cells:
            if cell_row != row_id:  # cells come row by row: one row lookup per row
                row_id, row = cell_row, data.get(RowKey(cell_row))
            column_key = columns.get(column_id)
            if row is None or column_key is None:
                raise CellDoesNotExist(f"No cell exists for row {cell_row!r}, column {column_id!r}")
            row[column_key] = value
            count += 1
        if count:
            self._update_count += 1
            self.refresh()
        return count

    def order_by(self, key: Callable[[str], Any], *, reverse: bool = False) -> None:
        """Order the rows by ``key(row id)``.

        ``DataTable.sort`` hands its key function the cells only, not the row's id, and the
        console orders by the model's values (numbers as numbers, the topology as a tree),
        not by rendered text. This does what ``sort`` does (textual 8.2.8, pinned) with the
        id in hand; ``tests/tui/test_console_app.py`` checks it still does.
        """
        ordered = sorted(self._data, key=lambda row_key: key(row_key.value or ""), reverse=reverse)
        locations: dict[RowKey, int] = {row_key: i for i, row_key in enumerate(ordered)}
        current = self._row_locations
        if all(current.get(row_key) == i for row_key, i in locations.items()):
            return  # already in order: no repaint
        self._row_locations = TwoWayDict(locations)
        self._update_count += 1
        self.refresh()
