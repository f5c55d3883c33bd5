"""The browser decision both HTTP ports share (llmgw.httpguard), with values."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.httpguard import (
    LOOPBACK_ONLY,
    BrowserAccess,
    BrowserAccessError,
    HttpGuard,
    is_loopback_host,
    normalise_origin,
)

CONSOLE = BrowserAccess.parse(["https://Console.Example"], ["gpu-box.lan"])


@pytest.mark.parametrize(
    ("given_", "normal"),
    [
        ("https://console.example", "https://console.example:443"),
        ("HTTPS://Console.EXAMPLE:443/", "https://console.example:443"),
        ("http://console.example", "http://console.example:80"),
        ("http://127.0.0.1:3000", "http://127.0.0.1:3000"),
        ("http://[::1]:8080", "http://[::1]:8080"),
        ("http://[0:0::1]", "http://[::1]:80"),
    ],
)
def test_origins_are_normalised(given_: str, normal: str) -> None:
    assert normalise_origin(given_) == normal


@pytest.mark.parametrize(
    "bad", ["null", "", "console.example", "ftp://x", "http://", "http://a/b", "http://u@a",
            "http://a?x", "http://a:99999", "http://a b"]
)  # fmt: skip
def test_what_is_not_an_origin_is_refused_naming_the_flag(bad: str) -> None:
    with pytest.raises(BrowserAccessError, match="--cors-origin"):
        BrowserAccess.parse([bad], [])


@pytest.mark.parametrize("bad", ["http://x", "a:80", "a b", "", "-x."])
def test_what_is_not_a_host_is_refused_naming_the_flag(bad: str) -> None:
    with pytest.raises(BrowserAccessError, match="--allowed-host"):
        BrowserAccess.parse([], [bad])


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost", True), ("LOCALHOST.", True), ("app.localhost", True), ("127.0.0.1", True),
     ("127.9.8.7", True), ("::1", True), ("[::1]", True), ("10.0.0.1", False),
     ("0.0.0.0", False), ("::", False), ("localhost.evil.example", False), ("myhost", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:8080", "localhost:8080", "LocalHost", "[::1]:8080", "x.localhost:1", "127.0.0.5"],
)
def test_loopback_hosts_are_answered_by_default(host: str) -> None:
    assert LOOPBACK_ONLY.refusal(host, None) is None


@pytest.mark.parametrize(
    "host",
    ["evil.example:8080", "evil.example", "10.0.0.1:8080", "127.0.0.1.evil.example",
     "localhost:http", "[::1", "a b", ""],
)  # fmt: skip
def test_other_hosts_are_refused(host: str) -> None:
    refusal = LOOPBACK_ONLY.refusal(host, None)
    assert refusal is not None and refusal.status == 403
    assert "--allowed-host" in refusal.message


def test_a_missing_host_is_refused_on_http11_only() -> None:
    assert LOOPBACK_ONLY.refusal(None, None) == LOOPBACK_ONLY.refusal(None, None, http11=True)
    refusal = LOOPBACK_ONLY.refusal(None, None)
    assert refusal is not None and refusal.status == 400
    assert LOOPBACK_ONLY.refusal(None, None, http11=False) is None


def test_the_listen_address_and_allowed_names_are_answered() -> None:
    guard = HttpGuard(CONSOLE, "10.1.2.3")
    for host in ("10.1.2.3:8080", "GPU-BOX.lan:8080", "gpu-box.lan", "localhost"):
        assert guard.refusal(host, None) is None, host
    for host in ("10.1.2.4:8080", "other.lan"):
        assert guard.refusal(host, None) is not None, host


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_a_wildcard_listener_answers_ip_literals_but_no_names(wildcard: str) -> None:
    guard = HttpGuard(CONSOLE, wildcard)
    for host in ("10.1.2.3:8080", "192.168.0.9", "[fd00::5]:8080", "gpu-box.lan", "localhost"):
        assert guard.refusal(host, None) is None, host
    assert guard.refusal("rebind.evil.example:8080", None) is not None


def test_no_origin_is_allowed_by_default_but_the_ports_own() -> None:
    for origin in ("http://evil.example", "null", "http://127.0.0.1:3000", "garbage",
                   "https://127.0.0.1:8080"):  # fmt: skip
        refusal = LOOPBACK_ONLY.refusal("127.0.0.1:8080", origin)
        assert refusal is not None and refusal.status == 403, origin
        assert "--cors-origin" in refusal.message
        assert not LOOPBACK_ONLY.cors_allows(origin)
    assert LOOPBACK_ONLY.refusal("127.0.0.1:8080", "http://127.0.0.1:8080") is None
    assert LOOPBACK_ONLY.refusal("localhost", "http://localhost") is None
    tls = HttpGuard(listen_host="127.0.0.1", tls=True)
    assert tls.refusal("localhost", "https://localhost") is None
    assert tls.refusal("localhost", "http://localhost") is not None


def test_an_opted_in_origin_is_answered_with_cors() -> None:
    guard = HttpGuard(CONSOLE)
    origin: str | None
    for origin in ("https://console.example", "https://CONSOLE.example:443"):
        assert guard.refusal("127.0.0.1:8080", origin) is None
        assert guard.cors_allows(origin)
    for origin in ("http://console.example", "https://console.example:8443", None):
        assert not guard.cors_allows(origin)
    assert guard.refusal("127.0.0.1:8080", "http://console.example") is not None
    rebound = guard.refusal("evil.example", "https://console.example")
    assert rebound is not None  # the Host check comes first


@given(st.text(max_size=40), st.one_of(st.none(), st.text(max_size=40)), st.booleans())
def test_any_headers_get_a_decision(host: str, origin: str | None, http11: bool) -> None:
    refusal = HttpGuard(CONSOLE, "0.0.0.0").refusal(host, origin, http11=http11)
    assert refusal is None or refusal.status in (400, 403)
