"""Which web pages and which Host names an HTTP port answers; imports nothing else of llmgw.

A browser lets any page send requests to any address it can reach, loopback included: a
"simple" cross-origin POST goes out without asking, and a page under a name its attacker
points at 127.0.0.1 (DNS rebinding) is even same-origin with our port. Both arrive with
headers a browser cannot forge: ``Origin`` names the page, ``Host`` the name it used. The
gRPC-web port (``llmgw.server.wire.grpcweb``) and the gateway port
(``llmgw.gateway.httpserver``) ask :meth:`HttpGuard.refusal` about every request
before any handler runs, and answer its :class:`Refusal` (403, or 400 for a request
without a Host).

**Host.** A request is answered when its Host (port aside) is a loopback name
(``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``::1``), the address the port listens on,
or a name the operator allowed (``--allowed-host``). A port listening on every address
(``0.0.0.0``, ``::``) also answers any IP literal: rebinding needs a name. An HTTP/1.1
request without a Host is refused (400).

**Origin.** No cross-origin access unless opted in: a request that carries an Origin is
answered only when that origin is one of ``--cors-origin`` (it then gets
``Access-Control-Allow-Origin``, see :meth:`HttpGuard.cors_allows`) or is the port's own
origin (the port's scheme, and the request's Host, which passed the Host check).
Clients that are not browsers (the console, the CLI, ``buf curl``, OpenAI SDKs) send no
Origin and are not affected.

Origins are compared normalised (:func:`normalise_origin`): scheme and host in lower case,
the port always written, 80 for ``http`` and 443 for ``https`` when left out.

Exceptions: one, :class:`BrowserAccessError` (a ``ValueError``), for a ``--cors-origin`` or
``--allowed-host`` value that is not one; its message names the flag and the value. Each
caller maps it to its own tree at one place.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "BrowserAccess",
    "BrowserAccessError",
    "LOOPBACK_ONLY",
    "HttpGuard",
    "Refusal",
    "is_loopback_host",
    "normalise_origin",
]

_DEFAULT_PORTS: Final = {"http": 80, "https": 443}
_WILDCARDS: Final = frozenset({"", "0.0.0.0", "::"})
_MAX_REMEMBERED: Final = 1024
_LABEL: Final = r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?"
_NAME: Final = re.compile(rf"{_LABEL}(\.{_LABEL})*")


class BrowserAccessError(ValueError):
    """A ``--cors-origin`` or ``--allowed-host`` value that is not one."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not answered: the HTTP status and a message for the client."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class BrowserAccess:
    """What the operator opened up: cross-origin pages and extra Host names."""

    cors_origins: frozenset[str] = frozenset()  # normalised (normalise_origin)
    allowed_hosts: frozenset[str] = frozenset()  # lower case, without a port

    @classmethod
    def parse(cls, origins: Iterable[str], hosts: Iterable[str]) -> BrowserAccess:
        """``--cors-origin`` and ``--allowed-host`` values; BrowserAccessError naming one
        that is not an origin or a host name."""
        normalised = set()
        for origin in origins:
            try:
                normalised.add(normalise_origin(origin))
            except ValueError as exc:
                raise BrowserAccessError(f"--cors-origin {origin!r}: {exc}") from exc
        names = set()
        for host in hosts:
            name = _host_name(host)
            if name is None:
                raise BrowserAccessError(
                    f"--allowed-host {host!r} is not a host name or IP address "
                    "(for example console.example, without a scheme or port)"
                )
            names.add(name)
        return cls(frozenset(normalised), frozenset(names))


def normalise_origin(text: str) -> str:
    """``scheme://host:port`` in lower case with the port always written; ValueError for
    anything that is not an http(s) origin (a path, a query, user info, ``null``)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not an origin ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("not an origin: it must start with http:// or https://")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
        raise ValueError("not an origin: scheme, host and port only, no path")
    host = _host_name(parts.hostname or "")
    if host is None:
        raise ValueError("not an origin: the host is missing or malformed")
    return f"{scheme}://{_bracketed(host)}:{port or _DEFAULT_PORTS[scheme]}"


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or IP literal, without a port) can only mean this machine."""
    name = _host_name(host)
    if name is None:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    address = _ip(name)
    return address is not None and address.is_loopback


@dataclass(frozen=True, slots=True)
class HttpGuard:
    """The decision for one listening port (see the module docstring)."""

    access: BrowserAccess = BrowserAccess()
    listen_host: str = "127.0.0.1"  # the address the port is bound to
    tls: bool = False  # the port serves https (the default port of its own origin)
    _listen: str | None = field(init=False, repr=False, compare=False, default=None)
    _hosts: dict[str, tuple[str, int | None] | None] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )  # Host header → what _allowed_host said: a port sees few, each on every request

    def __post_init__(self) -> None:
        object.__setattr__(self, "_listen", _host_name(self.listen_host))

    def refusal(
        self, host: str | None, origin: str | None, *, http11: bool = True
    ) -> Refusal | None:
        """None when the request may be answered; else why not."""
        if host is None:
            return Refusal(400, "a Host header is required") if http11 else None
        try:
            parsed = self._hosts[host]
        except KeyError:
            parsed = self._remember_host(host)
        if parsed is None:
            return Refusal(
                403,
                f"Host {host!r} is not an address of this server (a DNS rebinding guard); "
                "the operator can allow the name with --allowed-host",
            )
        if origin is None or self.cors_allows(origin):
            return None
        if self._own_origin(origin, parsed):
            return None
        return Refusal(
            403,
            f"Origin {origin!r} is not allowed (cross-origin requests are refused); "
            "the operator can allow it with --cors-origin",
        )

    def cors_allows(self, origin: str | None) -> bool:
        """Whether ``origin`` is one of ``--cors-origin`` (its responses carry
        ``Access-Control-Allow-Origin``)."""
        if origin is None or not self.access.cors_origins:
            return False
        return _normalised_or_none(origin) in self.access.cors_origins

    def _remember_host(self, host: str) -> tuple[str, int | None] | None:
        if len(self._hosts) >= _MAX_REMEMBERED:
            self._hosts.clear()  # a client making up names; start over
        parsed = _split_host(host)
        if parsed is not None and not self._host_allowed(parsed[0]):
            parsed = None
        self._hosts[host] = parsed
        return parsed

    def _host_allowed(self, name: str) -> bool:
        if is_loopback_host(name) or name in self.access.allowed_hosts:
            return True
        if self._listen is not None and name == self._listen:
            return True
        return self.listen_host in _WILDCARDS and _ip(name) is not None

    def _own_origin(self, origin: str, host: tuple[str, int | None]) -> bool:
        normalised = _normalised_or_none(origin)
        scheme = "https" if self.tls else "http"
        own_port = host[1] or _DEFAULT_PORTS[scheme]
        return normalised == f"{scheme}://{_bracketed(host[0])}:{own_port}"


@functools.lru_cache(maxsize=256)  # the same few origins on every request
def _normalised_or_none(origin: str) -> str | None:
    try:
        return normalise_origin(origin)
    except ValueError:
        return None


def _split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (name, port); None when it is malformed."""
    value = value.strip()
    if value.startswith("["):
        inside, bracket, rest = value[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        name, port_text = inside, rest[1:] if rest else None
    else:
        name, colon, port_text_or_empty = value.partition(":")
        port_text = port_text_or_empty if colon else None
    if port_text is not None and not (port_text.isdigit() and int(port_text) <= 65535):
        return None
    host = _host_name(name)
    if host is None:
        return None
    return host, None if port_text is None else int(port_text)


def _host_name(text: str) -> str | None:
    """A host name or IP literal in canonical form (lower case, no trailing dot, IPv6
    without brackets and compressed); None when it is neither."""
    text = text.strip().strip("[]").lower()
    address = _ip(text)
    if address is not None:
        return str(address)
    text = text.removesuffix(".")
    return text if text and len(text) <= 253 and _NAME.fullmatch(text) else None


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


LOOPBACK_ONLY: Final = HttpGuard()
"""No cross-origin page, and only loopback Host names: the default of every port."""
