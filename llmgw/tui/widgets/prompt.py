"""The ``:`` prompt: type a view's name (or alias), Enter jumps to it, Esc leaves."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.suggester import SuggestFromList
from textual.widgets import Input

from llmgw.tui.registry import VIEWS

__all__ = ["JumpPrompt"]


class JumpPrompt(Input):
    """A one-line command input, hidden until ``:`` opens it."""

    BINDINGS = [Binding("escape", "dismiss", "close", show=False)]

    class Dismissed(Message):
        """The prompt was closed without a command."""

    def __init__(self, *, id: str | None = None) -> None:
        words = [v.name for v in VIEWS] + [a for v in VIEWS for a in v.aliases]
        super().__init__(
            placeholder="view: " + " ".join(v.name for v in VIEWS),
            suggester=SuggestFromList(words, case_sensitive=False),
            id=id,
        )

    def action_dismiss(self) -> None:
        self.post_message(self.Dismissed())
