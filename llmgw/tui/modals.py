"""The confirmations and choices an operator action goes through, and the outcome it reports.

``ConfirmScreen`` shows an ``Operation`` (``llmgw.tui.actions``): its exact targets and its
impact, with Cancel focused, so a stray Enter does nothing; Esc cancels too. Confirming
sends the one RPC in a worker (``propose``), and the outcome becomes a notification: the
server's words when it acts, error severity with its message when it refuses. The audit
record it writes reaches the events view through Watch. ``ChoiceScreen`` is a list to pick
from (the stored profiles for reprofile, the deployments for start), Esc for none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, OptionList, Static
from textual.widgets.option_list import Option

from llmgw.client import ClientError, ControlClient, RpcError, ServerUnreachable
from llmgw.tui.actions import ActionUnavailable, Operation, send
from llmgw.tui.widgets.cells import shown

__all__ = [
    "Choice",
    "ChoiceScreen",
    "ConfirmScreen",
    "choose",
    "operation_text",
    "propose",
    "report",
    "unavailable",
]

_NOTICE_S = 10.0  # outcomes stay up longer than the default five seconds


def operation_text(operation: Operation) -> RenderableType:
    """The body of a confirmation: the targets, then the impact, lines with hanging indents."""
    return Group(
        Text("Targets", style="bold"),
        _indented(" •", operation.targets),
        Text(""),
        Text("Impact", style="bold"),
        _indented("  ", operation.impact),
    )


def _indented(mark: str, lines: Sequence[str]) -> Table:
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for line in lines:
        grid.add_row(mark, shown(line))
    return grid


class ConfirmScreen(ModalScreen[bool]):
    """One operation, Cancel focused; dismissed with True only by the confirming button."""

    AUTO_FOCUS = "#cancel"
    BINDINGS = [
        Binding("escape", "cancel", "cancel"),
        Binding("left", "app.focus_previous", "previous", show=False),
        Binding("right", "app.focus_next", "next", show=False),
    ]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical {
        width: 100%; max-width: 78; height: auto; max-height: 100%;
        border: round $error; border-title-style: bold; padding: 0 1; background: $surface;
    }
    ConfirmScreen #confirm-body { height: auto; }
    ConfirmScreen Horizontal { height: auto; align-horizontal: right; margin-top: 1; }
    ConfirmScreen Button { margin-left: 2; }
    """

    def __init__(self, operation: Operation) -> None:
        super().__init__()
        self.operation = operation

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = self.operation.title
            box.border_subtitle = "esc: cancel"
            yield Static(operation_text(self.operation), id="confirm-body")
            with Horizontal():
                yield Button("Cancel", id="cancel")
                yield Button(self.operation.confirm, id="confirm", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm")

    def action_cancel(self) -> None:
        self.dismiss(False)


@dataclass(frozen=True, slots=True)
class Choice:
    """One line of a ``ChoiceScreen``: ``value`` is what choosing it returns."""

    value: str
    label: str
    disabled: bool = False  # shown, not choosable (the profile in use)


class ChoiceScreen(ModalScreen[str | None]):
    """A list to choose one from (Enter), or none (Esc)."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]
    DEFAULT_CSS = """
    ChoiceScreen { align: center middle; }
    ChoiceScreen > Vertical {
        width: 100%; max-width: 78; height: auto; max-height: 100%;
        border: round $accent; border-title-style: bold; padding: 0 1; background: $surface;
    }
    ChoiceScreen #choice-note { height: auto; margin-bottom: 1; }
    ChoiceScreen OptionList { height: auto; max-height: 16; }
    """

    def __init__(
        self, title: str, note: str, choices: Sequence[Choice], highlight: str = ""
    ) -> None:
        super().__init__()
        self._title = title
        self._note = note
        self.choices = tuple(choices)
        self._highlight = highlight  # the value highlighted first (the profile in use)

    def compose(self) -> ComposeResult:
        options = [Option(shown(c.label), id=c.value, disabled=c.disabled) for c in self.choices]
        with Vertical() as box:
            box.border_title = self._title
            box.border_subtitle = "enter: choose · esc: cancel"
            yield Static(shown(self._note), id="choice-note")
            yield OptionList(*options, id="choices")

    def on_mount(self) -> None:
        listing = self.query_one(OptionList)
        marked = next((i for i, c in enumerate(self.choices) if c.value == self._highlight), None)
        first = next((i for i, c in enumerate(self.choices) if not c.disabled), None)
        listing.highlighted = marked if marked is not None else first
        listing.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


# --- the flow ------------------------------------------------------------------------------


def unavailable(app: App[Any], exc: ActionUnavailable) -> None:
    app.notify(exc.why, title="nothing sent", severity="warning", markup=False)


def propose(app: App[Any], operation: Operation, client: ControlClient | None) -> None:
    """Ask for confirmation; when given, send ``operation`` and report how it went."""

    def answered(confirmed: bool | None) -> None:
        if confirmed:
            app.run_worker(report(app, operation, client), group="operate", name="operate")

    app.push_screen(ConfirmScreen(operation), answered)


def choose(
    app: App[Any],
    screen: ChoiceScreen,
    then: Callable[[str], None],
) -> None:
    """Show ``screen``; call ``then`` with the value chosen, nothing when none is."""

    def chosen(value: str | None) -> None:
        if value:
            then(value)

    app.push_screen(screen, chosen)


async def report(app: App[Any], operation: Operation, client: ControlClient | None) -> None:
    """Send ``operation``; notify its outcome (errors with error severity)."""
    title = operation.title
    if client is None:
        app.notify("this console has no connection to send actions on", title=title,
                   severity="error")  # fmt: skip
        return
    try:
        result = await send(operation, client)
    except RpcError as exc:
        refused = f"{title}: refused ({exc.status.name})"
        _error(app, exc.message or exc.status.name, refused)
    except ServerUnreachable as exc:
        _error(app, f"the server could not be reached: {exc.reason}", f"{title}: not done")
    except ClientError as exc:
        _error(app, str(exc), f"{title}: not sent")
    else:
        if result.ok:
            app.notify(result.message or "done", title=title, markup=False, timeout=_NOTICE_S)
        else:
            _error(app, result.message or "the server did not do it", f"{title}: refused")


def _error(app: App[Any], message: str, title: str) -> None:
    app.notify(message, title=title, severity="error", markup=False, timeout=_NOTICE_S)
