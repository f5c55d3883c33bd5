"""The console fits the terminal: footer hints dropped whole by rank (``?`` help stays),
columns sized to content with the widest name column giving way first, states never."""

from __future__ import annotations

import pytest
from test_console_fit_snapshots import LongIdFeed

from llmgw.tui.app import ConsoleApp
from llmgw.tui.columns import CELL_PADDING, ColumnFit, fit_columns
from llmgw.tui.hints import Hint, fit_hints, hints_text
from llmgw.tui.registry import ACTIONS

HINTS = [
    Hint(":", "view", 2),
    Hint("?", "help", 0),
    Hint("d", "drain", 1),
    Hint("/", "filter", 3),
    Hint("c", "copy id", 4),
    Hint("q", "quit", 4),
]


def test_every_hint_when_there_is_room() -> None:
    text = hints_text(fit_hints(HINTS, 200)).plain
    assert text == ": view  ? help  d drain  / filter  c copy id  q quit"


def test_whole_hints_go_by_rank_the_last_listed_first() -> None:
    width = len(": view  ? help  d drain  / filter  c copy id")
    assert [h.words for h in fit_hints(HINTS, width)] == ["view", "help", "drain", "filter",
                                                           "copy id"]  # fmt: skip
    assert [h.words for h in fit_hints(HINTS, width - 1)] == ["view", "help", "drain", "filter"]
    assert [h.words for h in fit_hints(HINTS, 16)] == ["help", "drain"]


def test_help_stays_however_narrow() -> None:
    assert fit_hints(HINTS, 3) == [Hint("?", "help", 0)]


def test_columns_get_what_they_want_when_it_fits() -> None:
    cols = [ColumnFit(10, 25, flex=True, floor=8), ColumnFit(11), ColumnFit(4, 6, True, 4)]
    assert fit_columns(cols, 25 + 11 + 6 + 3 * CELL_PADDING) == [25, 11, 6]


def test_the_widest_flexible_column_gives_way_first_and_fixed_ones_never() -> None:
    cols = [ColumnFit(10, 25, flex=True, floor=8), ColumnFit(11), ColumnFit(4, 12, True, 4)]
    room = 11 + 3 * CELL_PADDING
    assert fit_columns(cols, room + 30) == [18, 11, 12]  # only the widest shrank
    assert fit_columns(cols, room + 20) == [10, 11, 10]  # then both, the wider first
    assert fit_columns(cols, room) == [8, 11, 4]  # floors: the table scrolls sideways


async def _footer_and_rows(view: str, size: tuple[int, int]) -> tuple[str, list[str]]:
    app = ConsoleApp(LongIdFeed(), view=view)
    async with app.run_test(size=size) as pilot:
        for _ in range(100):
            if app.displayed.revision == 414:
                break
            await pilot.pause(0.05)
        await pilot.pause()
        lines = [strip.text for strip in app.screen._compositor.render_strips()]
        return lines[-1], lines


@pytest.mark.parametrize("view", ["overview", "nodes", "replicas", "shards", "events"])
@pytest.mark.parametrize("size", [(80, 24), (60, 20), (160, 50)])
async def test_the_footer_shows_only_whole_hints_and_always_help(
    view: str, size: tuple[int, int]
) -> None:
    footer, _ = await _footer_and_rows(view, size)
    assert len(footer.rstrip()) <= size[0]
    shown = [part.strip() for part in footer.strip().split("  ") if part.strip()]
    known = {f"{a.key_display or a.keys.split(',')[0]} {a.description}" for a in ACTIONS}
    assert "? help" in shown
    assert set(shown) <= known, shown  # every piece is a whole hint, none cut


async def test_states_stay_whole_and_long_ids_end_in_an_ellipsis_at_80() -> None:
    _, lines = await _footer_and_rows("nodes", (80, 24))
    assert any("⊘ CORDONED" in line for line in lines)
    assert any("a100-mig-…" in line for line in lines)  # cut, with an ellipsis
    _, wide = await _footer_and_rows("nodes", (160, 50))
    assert any("a100-mig-pod1-rack03-node017" in line and "⊘ CORDONED" in line for line in wide)
    assert any("4×A100 (12 MIG slices)" in line for line in wide)
