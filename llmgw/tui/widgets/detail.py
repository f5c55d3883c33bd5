"""The detail page Enter opens over a view; Esc, q or Enter closes it."""

from __future__ import annotations

from rich.console import RenderableType
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

__all__ = ["DetailScreen"]


class DetailScreen(ModalScreen[None]):
    """A title and a body, scrollable, over the view it came from."""

    BINDINGS = [
        Binding("escape", "close", "back"),
        Binding("q", "close", "back", show=False),
        Binding("enter", "close", "back", show=False),
    ]
    DEFAULT_CSS = """
    DetailScreen { align: center middle; }
    DetailScreen > VerticalScroll {
        width: 100%; max-width: 120; height: auto; max-height: 100%;
        border: round $accent; border-title-style: bold; padding: 0 1; background: $surface;
    }
    """

    def __init__(self, title: str, body: RenderableType) -> None:
        super().__init__()
        self._title = title
        self._body = body

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = self._title
            box.border_subtitle = "esc: back"
            yield Static(self._body, id="detail-body")

    def add_section(self, body: RenderableType) -> None:
        """Show ``body`` under the detail (what came later: the object's recent events)."""
        if self.is_attached:
            self.query_one(VerticalScroll).mount(Static(body, classes="detail-section"))

    def action_close(self) -> None:
        self.dismiss(None)
