"""The link badge: ``LIVE``, ``STALE 12s``, ``RECONNECTING #3`` (and ``PAUSED``), in words."""

from __future__ import annotations

from textual.widgets import Static

from llmgw.tui.stream import LinkPhase, LinkStatus

__all__ = ["LinkBadge"]

_CLASSES = {phase: f"-{phase.value}" for phase in LinkPhase}


class LinkBadge(Static):
    """Shows a ``LinkStatus``; its class (``-live``, ``-stale``, …) gives its colour."""

    DEFAULT_CSS = """
    LinkBadge { width: auto; padding: 0 1; text-style: bold; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("CONNECTING", id=id, classes=_CLASSES[LinkPhase.CONNECTING])
        self.text = "CONNECTING"

    def show_status(self, status: LinkStatus, now: float, *, paused: bool) -> None:
        text = status.badge(now) + (" · PAUSED" if paused else "")
        for phase, name in _CLASSES.items():
            self.set_class(phase is status.phase, name)
        self.set_class(paused, "-paused")
        if text != self.text:
            self.text = text
            self.update(text)
