"""Client API keys of the OpenAI gateway, for ``llmgw server`` and ``llmgw gateway``.

``--gateway-api-key-file`` / ``--api-key-file`` name a file with one key per line (blank
lines and ``#`` comments skipped); without the flag, ``$LLMGW_GATEWAY_API_KEY`` holds one
key; with neither, the gateway is open to every client (as vLLM without ``--api-key``).
A file that cannot be read or holds no key is a CliError naming the flag, never the key.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.cli.errors import CliError

if TYPE_CHECKING:
    from llmgw.gateway.apikeys import ApiKeys

ENV = "LLMGW_GATEWAY_API_KEY"  # llmgw.gateway.apikeys.API_KEY_ENV (tested to agree)
HELP = (
    "require `Authorization: Bearer KEY` on the gateway's /v1 routes, KEY one of the keys in "
    f"FILE (one per line, '#' comments); /healthz and /metrics stay open (default: ${ENV} "
    "if set, else no key)"
)


EXPLAIN_HELP = (
    "keys (a file like the client key file) that may also see why a request went where it "
    "did: a request with `x-llmgw-explain: 1` and one of them is answered with "
    "`x-llmgw-route: tier=…; replica=…; matched=…; reason=…`; they are accepted as client "
    "keys too (default: none; then only a gateway without client keys explains, to anyone)"
)


def add_explain_key_file_flag(p: argparse.ArgumentParser, flag: str) -> None:
    """``flag FILE`` for the keys that may see ``x-llmgw-route``."""
    p.add_argument(flag, type=Path, default=None, metavar="FILE", help=EXPLAIN_HELP)


def explain_keys(path: Path | None, flag: str) -> ApiKeys:
    """The keys in ``path`` (none without one); read and checked as client key files."""
    from llmgw.gateway.apikeys import ApiKeys

    if path is None:
        return ApiKeys()
    return gateway_api_keys(path, flag, {})


def add_key_file_flag(p: argparse.ArgumentParser, flag: str) -> None:
    """``flag FILE`` for the gateway's client keys."""
    p.add_argument(flag, type=Path, default=None, metavar="FILE", help=HELP)


def gateway_api_keys(
    path: Path | None, flag: str, environ: Mapping[str, str] = os.environ
) -> ApiKeys:
    """The keys in ``path``, else the one in ``$LLMGW_GATEWAY_API_KEY``, else none."""
    from llmgw.gateway.apikeys import ApiKeys

    if path is None:
        value = environ.get(ENV, "")
        return ApiKeys.of(_parsed(value, f"${ENV}")) if value.strip() else ApiKeys()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{flag} {path}: cannot read it ({exc})") from exc
    return ApiKeys.of(_parsed(text, f"{flag} {path}"))


def _parsed(text: str, where: str) -> tuple[str, ...]:
    from llmgw.gateway.apikeys import parse_key_file

    try:
        return parse_key_file(text)
    except ValueError as exc:
        raise CliError(f"{where}: {exc}") from exc
