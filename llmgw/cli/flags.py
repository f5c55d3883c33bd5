"""Flags and defaults that several commands share, and the checks of their values.

``--gateway-policy``/``--policy`` words, the precise tier's ``/tokenize`` bound and the
holding of requests for a model scaled to zero (``llmgw server``, ``llmgw gateway``),
``--engine-ports LO-HI`` (``llmgw server``, ``llmgw demo``) and token files
(``--join-token-file``, ``--token-file``). A bad value is a ``CliError`` naming the flag.
Imports only the standard library and ``llmgw.cli.errors`` at import time; what a check
needs is imported when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.cli.errors import CliError

if TYPE_CHECKING:
    from llmgw.gateway import HoldConfig

__all__ = [
    "GATEWAY_POLICIES",
    "add_hold_flags",
    "add_tokenize_timeout_flag",
    "engine_ports_flag",
    "hold_config",
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


def add_hold_flags(p: argparse.ArgumentParser, prefix: str) -> None:
    """``--{prefix}hold-queue`` and ``--{prefix}hold-timeout`` (None: ``HoldConfig``'s)."""
    p.add_argument(
        f"--{prefix}hold-queue",
        type=int,
        default=None,
        metavar="N",
        help="requests held per model while an autoscaled deployment (mode act) has no "
        "READY replica, waiting for the one the autoscaler starts; one more is answered "
        "503 with Retry-After at once; 0 holds none (default: 128)",
    )
    p.add_argument(
        f"--{prefix}hold-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a held request waits for a READY replica before it is answered "
        "503 with Retry-After (default: 120; at most 3600)",
    )


def hold_config(queue: int | None, timeout_s: float | None, prefix: str) -> HoldConfig:
    """The hold flags' values, checked (a bad one names its flag); defaults when not given."""
    from llmgw.gateway import HoldConfig
    from llmgw.gateway.holding import MAX_HELD_LIMIT, MAX_HOLD_TIMEOUT_S

    default = HoldConfig()
    if queue is not None and not 0 <= queue <= MAX_HELD_LIMIT:
        raise CliError(f"--{prefix}hold-queue must be 0 to {MAX_HELD_LIMIT}, not {queue}")
    if timeout_s is not None and not 0 < timeout_s <= MAX_HOLD_TIMEOUT_S:  # NaN too
        raise CliError(
            f"--{prefix}hold-timeout must be above 0 and at most {MAX_HOLD_TIMEOUT_S:g} "
            f"seconds, not {timeout_s}"
        )
    return HoldConfig(
        max_per_model=default.max_per_model if queue is None else queue,
        timeout_s=default.timeout_s if timeout_s is None else timeout_s,
    )


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
