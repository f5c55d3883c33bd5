"""``KeyFooter``: one line of the view's key hints that always fits (``llmgw.tui.hints``).

It reads the screen's active bindings (what ``check_action`` leaves: the view's verbs, none
of them when read-only) whenever they change, and refits on every resize: whole hints are
dropped by rank, never a word cut, and ``?`` help stays.
"""

from __future__ import annotations

from textual.events import Resize
from textual.screen import Screen
from textual.widgets import Static

from llmgw.tui.hints import Hint, fit_hints, hint_rank, hints_text
from llmgw.tui.registry import action_named

__all__ = ["KeyFooter"]


class KeyFooter(Static):
    """The footer: key hints of the view on screen, fitted to the width."""

    DEFAULT_CSS = """
    KeyFooter {
        dock: bottom;
        height: 1;
        padding: 0 1;
        background: $footer-background;
        color: $footer-foreground;
    }
    """

    def on_mount(self) -> None:
        self.screen.bindings_updated_signal.subscribe(self, self._bindings_changed)
        self.refit()

    def on_unmount(self) -> None:
        self.screen.bindings_updated_signal.unsubscribe(self)

    def _bindings_changed(self, screen: Screen[object]) -> None:
        if self.is_attached and screen is self.screen:
            self.call_after_refresh(self.refit)

    def on_resize(self, event: Resize) -> None:
        self.refit()

    def hints(self) -> list[Hint]:
        """Every hint the screen's bindings offer now, in the registry's order."""
        active = self.screen.active_bindings
        seen: set[str] = set()
        hints = []
        palette = active.get(self.app.COMMAND_PALETTE_BINDING)
        extra = [palette] if palette is not None else []
        for _, binding, enabled, _ in [*active.values(), *extra]:
            shown = binding.show or binding.action == "command_palette"
            if not shown or not enabled or binding.action in seen:
                continue
            seen.add(binding.action)
            action = action_named(binding.action.partition("(")[0])
            key = self.app.get_key_display(binding)
            hints.append(Hint(key, binding.description, hint_rank(action)))
        return hints

    def refit(self) -> None:
        width = self.content_size.width or self.app.size.width - 2
        self.update(hints_text(fit_hints(self.hints(), width)))
