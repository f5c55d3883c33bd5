"""A view that is one keyed table: each snapshot is applied as a keyed diff, never rebuilt.

A ``TableView`` keeps the rows it shows last and the value behind each cell. A new
snapshot is diffed against them (``llmgw.tui.model.diff_rows``: by identity, then value);
inside one ``batch_update`` removed rows go, new rows come (keyed by the row's id) and a
changed row updates only the cells whose value changed: ``remove_row``, ``add_row`` and
``update_cell`` batched by ``KeyedTable`` so that a thousand of them cost one re-index or
repaint, not a thousand. Cells are ``LazyCell``s, drawn only when on screen. Columns that
depend on the clock (ages) are recomputed every snapshot and updated when their text
changes. The cursor stays on the same id and the order (the view's own, or the column
chosen with ``o`` or a header click) is kept across updates.

A filter (a predicate on rows) narrows what is shown through the same diff, so filtered-out
rows disappear and come back as rows, not as a rebuilt table. ``/`` sets one with
``set_filter``: a ``RowFilter`` over ``row_text``, the row's cells as shown (the clock
columns left out), kept per row object so an update renders only the rows that changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

from rich.cells import cell_len
from rich.console import RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.events import Resize
from textual.widget import Widget
from textual.widgets import DataTable

from llmgw.tui.columns import ColumnFit, fit_columns
from llmgw.tui.filter import RowFilter, RowTexts
from llmgw.tui.model import ConsoleSnapshot, diff_rows
from llmgw.tui.widgets.cells import LazyCell, plain
from llmgw.tui.widgets.keyed_table import KeyedTable

__all__ = ["FLEX_FLOOR", "Column", "TableView"]

FLEX_FLOOR = 8
"""The fewest cells a flexible column is cut to (its label's width when that is more)."""

R = TypeVar("R")


def _render_plain(value: Any) -> RenderableType:
    return plain("" if value is None else value)


def _plain_text(cell: RenderableType) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _text_width(value: Any) -> int:
    return cell_len(value if isinstance(value, str) else "" if value is None else str(value))


@dataclass(frozen=True, slots=True)
class Column(Generic[R]):
    """A column: ``value(row, now_ms)`` is what the cell shows (compared to skip updates),
    ``render(value)`` how, ``sort(row)`` what ``o`` orders by (default: the value).

    A ``flex`` column (a name or an id) is as wide as its widest cell, ``measure(value)``
    cells (default: the value as text), and the one that gives way when the terminal is
    too narrow (``llmgw.tui.columns``); any other keeps ``width``, which fits its cells."""

    key: str
    label: str
    width: int
    value: Callable[[R, int], Hashable]
    render: Callable[[Any], RenderableType] = _render_plain
    sort: Callable[[R], Any] | None = None
    ticks: bool = False  # depends on the clock: recomputed every snapshot
    flex: bool = False
    measure: Callable[[Any], int] = _text_width

    def sort_key(self, row: R, now_ms: int) -> tuple[bool, Any]:
        value = self.sort(row) if self.sort is not None else self.value(row, now_ms)
        return (value is None, value)


class TableView(Widget, Generic[R]):
    """One view, one keyed table. Subclasses give ``COLUMNS`` and ``rows_of``."""

    DEFAULT_CSS = """
    TableView { height: 1fr; }
    TableView > KeyedTable { height: 1fr; }
    """

    COLUMNS: ClassVar[Sequence[Column[Any]]] = ()
    TITLE: ClassVar[str] = ""

    def __init__(self, *, id: str) -> None:
        super().__init__(id=id)
        self.table = KeyedTable(id=f"{id}-table")
        self.accepts: Callable[[R], bool] | None = None  # the filter; None shows every row
        self.row_filter: RowFilter | None = None  # what ``/`` set (it sets ``accepts``)
        self._texts = RowTexts()
        self.sort_column: str | None = None
        self.sort_reverse = False
        self._shown: Mapping[str, R] = MappingProxyType({})
        self._values: dict[str, tuple[Hashable, ...]] = {}
        self._snapshot = ConsoleSnapshot.empty()
        self._ticking = [i for i, c in enumerate(self.COLUMNS) if c.ticks]
        self._flexing = [i for i, c in enumerate(self.COLUMNS) if c.flex]
        self._wants = {i: cell_len(self.COLUMNS[i].label) for i in self._flexing}
        # per flexible column: how many shown cells are how wide (kept as rows come and go)
        self._cell_widths: dict[int, Counter[int]] = {i: Counter() for i in self._flexing}

    # --- what subclasses say ------------------------------------------------------------

    def rows_of(self, snapshot: ConsoleSnapshot) -> Mapping[str, R]:
        raise NotImplementedError

    def order(self, key: str, row: R) -> Any:
        """The view's own order when no column is chosen (default: by id)."""
        return key

    def id_of(self, key: str) -> str:
        """The id ``c`` copies for a row (default: the row key)."""
        return key

    def detail(self, key: str, snapshot: ConsoleSnapshot) -> tuple[str, RenderableType] | None:
        """A title and body for the detail of row ``key`` (Enter); None when it has none."""
        return None

    def described(self, key: str) -> tuple[str, str] | None:
        """What ``Describe`` (kind, name) gives row ``key``'s recent events, shown under its
        detail; None when the row has none."""
        return None

    # --- the table ----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield self.table

    def on_mount(self) -> None:
        for column in self.COLUMNS:
            self.table.add_column(column.label, width=column.width, key=column.key)
        if self._shown:
            shown, self._shown = self._shown, MappingProxyType({})
            self._apply(shown, self._snapshot.taken_ms)
        self._fit()

    def on_resize(self, event: Resize) -> None:
        self._fit()

    # --- widths -------------------------------------------------------------------------

    def _count(self, values: tuple[Hashable, ...], sign: int) -> None:
        """Count a row's flexible cells in (``sign`` 1) or out (-1) of the widths shown."""
        for i in self._flexing:
            widths = self._cell_widths[i]
            width = self.COLUMNS[i].measure(values[i])
            widths[width] += sign
            if not widths[width]:
                del widths[width]

    def _recount(self, i: int, old: Hashable, new: Hashable) -> None:
        widths, measure = self._cell_widths[i], self.COLUMNS[i].measure
        before, after = measure(old), measure(new)
        if before != after:
            widths[after] += 1
            widths[before] -= 1
            if not widths[before]:
                del widths[before]

    def _measure(self) -> bool:
        """The width each flexible column wants for the rows shown; whether one changed."""
        changed = False
        for i in self._flexing:
            wants = max(max(self._cell_widths[i], default=0), cell_len(self.COLUMNS[i].label))
            changed = changed or wants != self._wants[i]
            self._wants[i] = wants
        return changed

    def _fit(self) -> None:
        """Set the column widths for the width the table has now (``fit_columns``)."""
        # Room for a vertical scrollbar is kept whether one shows yet or not: one appearing
        # later (rows added) would otherwise cover the last column's end.
        table = self.table
        available = (table.size.width or self.size.width) - table.styles.scrollbar_size_vertical
        if not self._flexing or available <= 0:
            return
        fits = [
            ColumnFit(
                c.width,
                self._wants.get(i, 0),
                c.flex,
                floor=min(self._wants.get(i, 0), max(cell_len(c.label), FLEX_FLOOR)),
            )
            for i, c in enumerate(self.COLUMNS)
        ]
        widths = fit_columns(fits, available)
        self.table.set_widths({c.key: w for c, w in zip(self.COLUMNS, widths, strict=True)})

    @property
    def snapshot(self) -> ConsoleSnapshot:
        """The snapshot this view shows."""
        return self._snapshot

    def selected_key(self) -> str | None:
        return self.table.selected_key()

    def selected_id(self) -> str | None:
        key = self.table.selected_key()
        return None if key is None else self.id_of(key)

    def shown_keys(self) -> list[str]:
        """The ids of the rows shown, in display order."""
        return [row.key.value or "" for row in self.table.ordered_rows]

    def show(self, snapshot: ConsoleSnapshot) -> None:
        """Bring the table to ``snapshot`` with a keyed diff."""
        self._snapshot = snapshot
        rows = self.rows_of(snapshot)
        if self.accepts is not None:
            self._texts.next_pass()
            accepts = self.accepts
            rows = MappingProxyType({k: r for k, r in rows.items() if accepts(r)})
        if not self.is_mounted:
            self._shown = rows  # applied on mount
            return
        self._apply(rows, snapshot.taken_ms)

    def refilter(self) -> None:
        """Apply a changed filter to the snapshot shown."""
        self.show(self._snapshot)

    def set_filter(self, row_filter: RowFilter | None) -> None:
        """Show only the rows ``row_filter`` matches (None: every row), now and after."""
        self.row_filter = row_filter
        if row_filter is None:
            self.accepts = None
        else:
            self.accepts = lambda row: row_filter.matches(self.row_text(row))
        self.refilter()

    def row_text(self, row: R) -> str:
        """The row's cells as the table shows them, joined by spaces (clock columns left
        out: an age is no word to filter on); what ``/`` searches."""
        return self._texts.text(row, lambda: self._render_text(row))

    def _render_text(self, row: R) -> str:
        now_ms = self._snapshot.taken_ms
        return " ".join(
            _plain_text(c.render(c.value(row, now_ms))) for c in self.COLUMNS if not c.ticks
        )

    def _apply(self, rows: Mapping[str, R], now_ms: int) -> None:
        diff = diff_rows(self._shown, rows)
        table = self.table
        selected = table.selected_key()
        reorder = bool(diff.added) or (bool(diff.changed) and self.sort_column is not None)
        cells: list[tuple[str, str, RenderableType]] = []
        with self.app.batch_update():
            table.remove_rows(diff.removed)
            for key in diff.removed:
                self._count(self._values.pop(key), -1)
            added = []
            for key in diff.added:
                values = self._values[key] = self._compute(rows[key], now_ms)
                self._count(values, 1)
                cells_of = [
                    LazyCell(c.render, v) for c, v in zip(self.COLUMNS, values, strict=True)
                ]
                added.append((key, cells_of))
            table.append_rows(added)
            for key in diff.changed:
                self._update(key, self._compute(rows[key], now_ms), cells)
            if self._ticking:
                self._tick(rows, set(diff.added) | set(diff.changed), now_ms, cells)
            table.update_cells(cells)
            self._shown = rows
            if self._flexing and self._measure():
                self._fit()
            if reorder:
                self._reorder(now_ms)
            if selected is not None:
                table.select_key(selected, scroll=False)

    def _compute(self, row: R, now_ms: int) -> tuple[Hashable, ...]:
        return tuple(column.value(row, now_ms) for column in self.COLUMNS)

    def _update(
        self, key: str, values: tuple[Hashable, ...], cells: list[tuple[str, str, RenderableType]]
    ) -> None:
        """Queue the cells of row ``key`` whose value changed."""
        old = self._values[key]
        if old == values:
            return
        self._values[key] = values
        for i in self._flexing:  # only the flexible cells that changed are measured again
            if old[i] != values[i]:
                self._recount(i, old[i], values[i])
        for column, before, after in zip(self.COLUMNS, old, values, strict=True):
            if before != after:
                cells.append((key, column.key, LazyCell(column.render, after)))

    def _tick(
        self,
        rows: Mapping[str, R],
        done: set[str],
        now_ms: int,
        cells: list[tuple[str, str, RenderableType]],
    ) -> None:
        for key, row in rows.items():
            if key in done:
                continue
            values = list(self._values[key])
            for i in self._ticking:
                values[i] = self.COLUMNS[i].value(row, now_ms)
            self._update(key, tuple(values), cells)

    # --- order --------------------------------------------------------------------------

    def sort_by(self, column: str | None, *, reverse: bool = False) -> None:
        """Order by ``column`` (None: the view's own order), kept across updates."""
        self.sort_column, self.sort_reverse = column, reverse
        selected = self.table.selected_key()
        self._reorder(self._snapshot.taken_ms)
        if selected is not None:
            self.table.select_key(selected)

    def cycle_sort(self) -> str:
        """``o``: the next column's order, ascending then descending, then the view's own."""
        keys = [c.key for c in self.COLUMNS]
        if self.sort_column is None:
            self.sort_by(keys[0])
        elif not self.sort_reverse:
            self.sort_by(self.sort_column, reverse=True)
        else:
            index = keys.index(self.sort_column) + 1
            self.sort_by(keys[index] if index < len(keys) else None)
        return self.describe_sort()

    def describe_sort(self) -> str:
        if self.sort_column is None:
            return f"{self.TITLE}: default order"
        label = next(c.label for c in self.COLUMNS if c.key == self.sort_column)
        return f"{self.TITLE}: by {label} {'▼' if self.sort_reverse else '▲'}"

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        column = event.column_key.value
        reverse = self.sort_column == column and not self.sort_reverse
        self.sort_by(column, reverse=reverse)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.app.call_later(self.app.run_action, "detail")

    def _reorder(self, now_ms: int) -> None:
        shown = self._shown
        column = next((c for c in self.COLUMNS if c.key == self.sort_column), None)
        if column is None:
            self.table.order_by(lambda k: self.order(k, shown[k]))
            return
        self.table.order_by(
            lambda k: (column.sort_key(shown[k], now_ms), self.order(k, shown[k])),
            reverse=self.sort_reverse,
        )
