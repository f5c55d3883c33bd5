"""Flags and defaults that several commands share, and the checks of their values.

``--gateway-policy``/``--policy`` words, the precise tier's ``/tokenize`` bound
(``llmgw server``, ``llmgw gateway``), ``--engine-ports LO-HI`` (``llmgw server``, ``llmgw
demo``) and token files (``--join-token-file``, ``--token-file``). A bad value is a
``CliError`` naming the flag. Imports only the standard library and ``llmgw.cli.errors`` at
import time; what a check needs is imported when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmgw.cli.errors import CliError

__all__ = [
    "GATEWAY_POLICIES",
    "add_tokenize_timeout_flag",
    "engine_ports_flag",
    "read_token_file",
    "tokenize_timeout",
]

GATEWAY_POLICIES = "prefix, round_robin, least_load or session"
"""The gateway's policies in words (llmgw.gateway.routing.policy.POLICIES, tested to agree)."""


def add_tokenize_timeout_flag(p: argparse.ArgumentParser, flag: str) -> None:
    """The precise tier's bound on a replica's ``/tokenize`` (None: ``GatewayConfig``'s)."""
    p.add_argument(
        flag,
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long the precise tier waits for a replica's /tokenize before the request "
        "is routed by the approximate prefix tree instead (default: 0.05); raise it for "
        "long chats or slow chat templates",
    )


def tokenize_timeout(value: float | None, flag: str) -> float:
    """The flag's value, checked; the gateway's default when it was not given."""
    from llmgw.gateway.app import TOKENIZE_TIMEOUT_S

    if value is None:
        return TOKENIZE_TIMEOUT_S
    if not 0 < value < float("inf"):  # NaN too
        raise CliError(f"{flag} must be a positive number of seconds, not {value}")
    return value


def engine_ports_flag(text: str | None) -> tuple[int, int] | None:
    """``--engine-ports LO-HI`` (``llmgw server``, ``llmgw demo``); None when not given."""
    from llmgw.engineports import PortRangeError, parse_port_range

    try:
        return None if text is None else parse_port_range(text)
    except PortRangeError as exc:
        raise CliError(f"--engine-ports {exc}") from exc


def read_token_file(path: Path, flag: str) -> str:
    """The token in a file, surrounding whitespace dropped; CliError naming the flag if not."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{flag} {path}: cannot read it ({exc})") from exc
    if not token:
        raise CliError(f"{flag} {path}: the file is empty")
    return token
