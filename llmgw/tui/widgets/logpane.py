"""The log pane ``l`` opens on a replica or a shard: its engine output, followed live.

It opens the stream it is given (``ControlClient.stream_logs`` with ``follow``: the last
``TAIL`` lines, then what the engine writes) in a worker of its own, and shows each line as
plain text, its control characters escaped (``llmgw.printable``: engine output holds what
prompts held), in a ``Log`` that keeps the last ``MAX_LINES``. Esc (or q) closes it, which
ends the worker and with it the stream (the server cancels the agent's side). When the
stream ends (the node disconnected, the token may not read logs) the pane says why in its
last line and keeps what it showed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Log, Static

from llmgw.api.llmgw.v1 import LogLines
from llmgw.client import ClientError
from llmgw.printable import escape

__all__ = ["MAX_LINES", "TAIL", "LogPane", "LogSource"]

MAX_LINES = 5000
TAIL = 200

LogSource = Callable[[], AsyncIterator[LogLines]]
"""Opens the stream the pane follows."""


class LogPane(ModalScreen[None]):
    """A replica's or a shard's engine output, over the view it came from."""

    BINDINGS = [
        Binding("escape", "close", "back"),
        Binding("q", "close", "back", show=False),
    ]
    DEFAULT_CSS = """
    LogPane { align: center middle; }
    LogPane > Vertical {
        width: 100%; height: 100%;
        border: round $accent; border-title-style: bold; background: $surface;
    }
    LogPane Log { height: 1fr; background: $surface; }
    LogPane #log-status { height: 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, name: str, source: LogSource) -> None:
        super().__init__()
        self.target = name
        self._source = source
        self.lines_shown = 0
        self.ended = ""  # why the stream ended ("" while it runs)

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"logs {self.target}"
            box.border_subtitle = "following · esc: back"
            yield Log(max_lines=MAX_LINES, id="log-lines")
            yield Static(f"reading the engine output of {self.target}…", id="log-status")

    def on_mount(self) -> None:
        self.run_worker(self._follow(), name="logs", group="logs", exclusive=True)

    async def _follow(self) -> None:
        lines = self.query_one("#log-lines", Log)
        status = self.query_one("#log-status", Static)
        stream = self._source()
        try:
            async for chunk in stream:
                if not self.lines_shown:
                    status.update(f"shard {chunk.shard_id}: following what its engine writes")
                lines.write_lines([escape(line.expandtabs()) for line in chunk.lines])
                self.lines_shown += len(chunk.lines)
            self._end("the log stream ended")
        except ClientError as exc:
            self._end(f"the log stream ended: {exc}")
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _end(self, why: str) -> None:
        self.ended = why
        self.query_one("#log-status", Static).update(Text(why, style="bold red"))
        self.query_one(Vertical).border_subtitle = "ended · esc: back"

    def action_close(self) -> None:
        self.dismiss(None)
