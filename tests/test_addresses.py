"""llmgw.addresses: one HOST:PORT parser for every command (each says whether port 0 is
allowed), a free loopback port, the XDG state home."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from llmgw.addresses import AddressError, bracketed, free_port, parse_host_port, state_home


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("ctl.example:50051", ("ctl.example", 50051)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::]:65535", ("::", 65535)),
        ("localhost:1", ("localhost", 1)),
    ],
)
def test_host_and_port_are_split_and_brackets_dropped(text: str, parsed: tuple[str, int]) -> None:
    assert parse_host_port(text, port_zero=False) == parsed
    assert parse_host_port(text, port_zero=True) == parsed


def test_port_zero_is_a_listen_address_only() -> None:
    assert parse_host_port("127.0.0.1:0", port_zero=True) == ("127.0.0.1", 0)
    with pytest.raises(AddressError, match=r"^port 0 is not in 1-65535$"):
        parse_host_port("127.0.0.1:0", port_zero=False)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("nowhere", "no :PORT"),
        (":8080", "no host before the port"),
        ("[]:8080", "no host before the port"),
        ("host:", "port '' is not a number"),
        ("host:http", "port 'http' is not a number"),
        ("host:-1", "port '-1' is not a number"),
        ("host:8²", "port '8²' is not a number"),  # str.isdigit alone would take it
        ("host:65536", "port 65536 is not in 0-65535"),
        ("a b:80", "'a b' is not a host name or address"),
        ("http://host:80", "'http://host' is not a host name or address"),
        ("user@host:80", "'user@host' is not a host name or address"),
        ("ho\x1bst:80", "'ho\\x1bst' is not a host name or address"),
    ],
)
def test_a_refusal_says_what_was_wrong(text: str, why: str) -> None:
    with pytest.raises(AddressError) as refused:
        parse_host_port(text, port_zero=True)
    assert str(refused.value) == why


def test_an_ipv6_host_is_bracketed_before_its_port() -> None:
    assert bracketed("::1") == "[::1]" and bracketed("ctl.example") == "ctl.example"


def test_a_free_port_is_the_preferred_one_unless_it_is_taken() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        other = free_port(taken)
        assert other != taken and 0 < other < 65536
    assert free_port(taken) == taken  # free again once the holder is closed


def test_the_state_home_is_xdg_state_home_or_dot_local_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert state_home() == tmp_path
    monkeypatch.setenv("XDG_STATE_HOME", "")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_home() == tmp_path / "home" / ".local" / "state"
