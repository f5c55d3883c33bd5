"""Log records off the screen while a full-screen program owns the terminal.

``llmgw console`` (and ``llmgw demo`` while its console is open) sends records to a file or
nowhere: a line on stderr would tear the screen.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.cli.errors import CliError

__all__ = ["logging_to"]


@contextmanager
def logging_to(path: Path | None) -> Iterator[None]:
    """Send log records to ``path`` (or nowhere) instead of stderr, then restore."""
    root = logging.getLogger()
    saved = root.handlers[:]
    handler: logging.Handler = logging.NullHandler()
    if path is not None:
        try:
            handler = logging.FileHandler(path, encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot open the log file {path}: {exc}") from exc
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved
        handler.close()
