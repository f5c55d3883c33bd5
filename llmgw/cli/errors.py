"""The command line's one exception: what a user can fix, printed as one line.

``CliError``
    A malformed flag, an unreadable file, a server that does not answer, a refusal: the
    message is printed as ``llmgw: MESSAGE`` on stderr and the process exits with
    ``exit_code`` (1 unless said otherwise; 130 for a stop by Ctrl-C or a signal). Every
    command maps the errors of what it calls (``ClientError``, ``ServerError``,
    ``TlsFileError`` …) to it with ``raise CliError(...) from exc``; only ``llmgw.cli.main``
    prints it. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["CliError"]


class CliError(Exception):
    """An error to print as one line, with the exit code to leave with."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
