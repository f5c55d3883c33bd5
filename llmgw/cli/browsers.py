"""Browser flags of what listens on HTTP (``llmgw server``, ``llmgw gateway``):
``--cors-origin`` opens a port to a web page's origin, ``--allowed-host`` to a Host name
beyond the listen address and loopback (``llmgw.httpguard`` decides; its errors become one
line here)."""

from __future__ import annotations

import argparse

from llmgw.cli.errors import CliError
from llmgw.httpguard import BrowserAccess, BrowserAccessError


def add_browser_flags(p: argparse.ArgumentParser, ports: str) -> None:
    """``--cors-origin`` and ``--allowed-host`` (repeatable) for ``ports`` (words for --help)."""
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help=f"let web pages from ORIGIN (scheme://host[:port], e.g. "
        f"https://console.example) call {ports} with CORS; repeatable (default: none, "
        "every request carrying another Origin is refused 403)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help=f"also answer requests to {ports} addressed to NAME (the Host header); "
        "repeatable (default: only the listen address, loopback names and, on 0.0.0.0 or "
        "::, IP addresses; others are refused 403 against DNS rebinding)",
    )


def browser_access(args: argparse.Namespace) -> BrowserAccess:
    """The parsed ``--cors-origin`` and ``--allowed-host`` values; CliError naming a bad one."""
    try:
        return BrowserAccess.parse(args.cors_origin, args.allowed_host)
    except BrowserAccessError as exc:
        raise CliError(str(exc)) from exc
