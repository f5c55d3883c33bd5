"""Addresses as the commands take them: ``HOST:PORT``, a free loopback port, the state home.

``HOST:PORT`` (or ``[V6]:PORT``) is parsed here for every command. A listen address may say
port 0 (the OS picks one, as the tests do), an address to connect to may not, so each caller
says which (``port_zero``). A refusal says what was wrong; the caller names its flag and gives
an example. Imports nothing of llmgw, so every package may import it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Final

LOOPBACK: Final = "127.0.0.1"
_NOT_IN_A_HOST: Final = "/?#@ "


class AddressError(ValueError):
    """A ``HOST:PORT`` refused; the message says what was wrong with it."""


def parse_host_port(text: str, *, port_zero: bool) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` → (host, port), the host without its brackets.

    ``port_zero``: whether port 0 is accepted (a listen address) or refused (an address to
    connect to). AddressError says which part is wrong."""
    host, sep, port = text.rpartition(":")
    bare = host.strip("[]")
    if not sep:
        raise AddressError("no :PORT")
    if not bare:
        raise AddressError("no host before the port")
    if not (port.isascii() and port.isdigit()):
        raise AddressError(f"port {port!r} is not a number")
    lowest = 0 if port_zero else 1
    if not lowest <= int(port) <= 65535:
        raise AddressError(f"port {int(port)} is not in {lowest}-65535")
    if any(c in bare for c in _NOT_IN_A_HOST) or not bare.isprintable():
        raise AddressError(f"{bare!r} is not a host name or address")
    return bare, int(port)


def bracketed(host: str) -> str:
    """``host`` as it goes before ``:PORT``: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def free_port(preferred: int = 0) -> int:
    """``preferred`` if it is free on 127.0.0.1, else a port that was free a moment ago
    (nothing listens on it when this returns)."""
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, preferred))
        except OSError:
            sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def state_home() -> Path:
    """``$XDG_STATE_HOME``, or ``~/.local/state`` where it is unset or empty."""
    return Path(os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state"))
