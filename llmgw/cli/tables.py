"""Text tables for people: ``llmgw get``, ``events``, ``console --once`` and the demo."""

from __future__ import annotations

from collections.abc import Sequence

from llmgw.printable import escape

__all__ = ["render_table"]


def render_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces; the first row is the header.

    Every cell is escaped (``llmgw.printable.escape``): a newline or an escape sequence in a
    hostname, a label or a reason prints as ``\\n``/``\\x1b``, never as a row of its own.
    """
    rows = [[escape(cell) for cell in row] for row in rows]
    if len(rows) <= 1:
        return "\n".join("  ".join(r) for r in rows) + ("\n(none)" if len(rows) == 1 else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
