"""Engine port ranges: parsing ``LO-HI``, and drawing a free window for one cluster."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import llmgw.engineports as ep
from llmgw.engineports import (
    DEFAULT_ENGINE_PORTS,
    NoFreeWindow,
    PortRange,
    PortRangeError,
    default_or_window,
    ephemeral_ports,
    format_port_range,
    parse_port_range,
    pick_window,
    ports_free,
    window_starts,
)

# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20000-29999", (20000, 29999)), (" 30000 - 30001 ", (30000, 30001)),
     ("1024-65535", (1024, 65535))],
)  # fmt: skip
def test_a_range_parses(text: str, expected: PortRange) -> None:
    assert parse_port_range(text) == expected


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("20000", "is not LO-HI"),
        ("20000:29999", "is not LO-HI"),
        ("a-b", "is not LO-HI"),
        ("", "is not LO-HI"),
        ("-5-10", "is not LO-HI"),
        ("20000-29999-30000", "is not LO-HI"),
        ("123456-123457", "is not LO-HI"),
        ("29999-20000", "the first port 29999 is above the last 20000"),
        ("80-8080", "is outside 1024-65535"),
        ("1023-2000", "is outside 1024-65535"),
        ("60000-65536", "is outside 1024-65535"),
        ("30000-30000", "has 1 port; at least 2"),
    ],
)
def test_a_bad_range_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(PortRangeError) as caught:
        parse_port_range(text)
    assert why in str(caught.value) and repr(text) in str(caught.value)
    assert isinstance(caught.value, ValueError)  # for callers that only know ValueError


@given(st.integers(1024, 65535), st.integers(1, 65535))
def test_every_valid_range_survives_format_then_parse(low: int, size: int) -> None:
    high = low + size
    if high > 65535:
        with pytest.raises(PortRangeError):
            parse_port_range(format_port_range((low, high)))
    else:
        assert parse_port_range(format_port_range((low, high))) == (low, high)


@given(st.text(max_size=30))
def test_any_text_parses_to_a_valid_range_or_is_refused(text: str) -> None:
    try:
        low, high = parse_port_range(text)
    except PortRangeError:
        return
    assert 1024 <= low < high <= 65535


# --- windows (pure) -------------------------------------------------------------------------


def test_window_starts_leave_out_every_start_that_would_overlap() -> None:
    assert window_starts((1000, 1999), 100, []) == [(1000, 1900)]
    # avoiding 1400-1499: a 100-port window may start up to 1300 or from 1500 on
    assert window_starts((1000, 1999), 100, [(1400, 1499)]) == [(1000, 1300), (1500, 1900)]
    assert window_starts((1000, 1999), 100, [(500, 1050), (1950, 3000)]) == [(1051, 1850)]
    assert window_starts((1000, 1099), 100, [(1099, 1099)]) == []
    assert window_starts((1000, 1050), 100, []) == []


@given(
    st.integers(2000, 60000),
    st.integers(2, 300),
    st.lists(st.tuples(st.integers(1024, 65535), st.integers(0, 3000)), max_size=5),
)
def test_every_allowed_start_gives_a_window_inside_the_span_clear_of_avoided(
    low: int, size: int, avoid_raw: list[tuple[int, int]]
) -> None:
    span = (low, min(65535, low + 4000))
    avoid = [(a, min(65535, a + n)) for a, n in avoid_raw]
    starts = window_starts(span, size, avoid)
    allowed = {s for first, last in starts for s in range(first, last + 1)}
    for start in range(span[0], span[1] + 1, 7):  # every 7th start, checked by hand
        end = start + size - 1
        ok = end <= span[1] and all(end < a or start > b for a, b in avoid)
        assert (start in allowed) == ok, (start, starts)


def test_a_window_is_drawn_clear_of_avoided_ranges_and_of_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ep, "ephemeral_ports", lambda: (20000, 29999))
    rng = random.Random(7)
    held: list[PortRange] = [(30000, 30199)]
    for _ in range(300):
        low, high = pick_window(200, span=(10000, 39999), avoid=held, rng=rng, is_free=_free)
        assert high - low == 199 and 10000 <= low and high <= 39999
        assert high < 20000 or low > 29999  # not in the ephemeral range
        assert high < 30000 or low > 30199  # not in the held window


def test_draws_spread_over_the_whole_room() -> None:
    rng = random.Random(1)
    lows = {pick_window(2, span=(3000, 3009), rng=rng, is_free=_free)[0] for _ in range(200)}
    assert lows == set(range(3000, 3009))  # every start, not a grid


def test_a_taken_window_is_skipped_and_none_free_is_an_error() -> None:
    asked: list[PortRange] = []

    def first_taken(window: PortRange) -> bool:
        asked.append(window)
        return len(asked) > 1

    window = pick_window(100, span=(40000, 49999), rng=random.Random(3), is_free=first_taken)
    assert window == asked[1] != asked[0]
    with pytest.raises(NoFreeWindow, match="no window of 100 free ports in 40000-49999"):
        pick_window(100, span=(40000, 49999), tries=5, is_free=lambda _: False)
    with pytest.raises(NoFreeWindow, match="no room for 100 ports in 40000-40050"):
        pick_window(100, span=(40000, 40050), is_free=_free)


def test_where_the_ephemeral_range_fills_the_span_it_is_not_avoided(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ep, "ephemeral_ports", lambda: (30000, 60999))
    assert 40000 <= pick_window(10, span=(40000, 40099), is_free=_free)[0] <= 40090


def test_the_default_range_when_its_bottom_is_free_else_a_window() -> None:
    asked: list[PortRange] = []

    def record(window: PortRange) -> bool:
        asked.append(window)
        return True

    assert default_or_window(is_free=record) == DEFAULT_ENGINE_PORTS
    assert asked == [(20000, 20199)]  # where a cluster on the default range starts engines
    window = default_or_window(rng=random.Random(5), is_free=lambda w: w[0] != 20000)
    assert window != DEFAULT_ENGINE_PORTS and window[1] - window[0] == 199
    assert window[0] >= ep.WINDOW_SPAN[0]


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert ephemeral_ports(path) == (32768, 60999)
    path.write_text("garbage")
    assert ephemeral_ports(path) is None
    assert ephemeral_ports(tmp_path / "missing") is None


# --- on this machine --------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[int]:
    """A port held by a listening socket on loopback, for the test's length, with three free
    ports on one side of it (the kernel hands out ports whose neighbours the other tests'
    connections may hold: such a port is given back and another taken, at most 20 times)."""
    with contextlib.ExitStack() as held:
        for _ in range(20):
            s = held.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = int(s.getsockname()[1])
            if ports_free((port + 1, port + 3)) or ports_free((port - 3, port - 1)):
                break
        yield port


def test_a_listened_port_makes_its_window_taken(listener: int) -> None:
    assert not ports_free((listener, listener))
    assert not ports_free((listener - 1, listener + 1))
    window = pick_window(3, span=(listener - 3, listener + 3), avoid=[], is_free=ports_free)
    assert listener not in range(window[0], window[1] + 1)


def test_a_real_window_is_free_and_outside_the_ephemeral_range() -> None:
    low, high = pick_window()
    assert high - low + 1 == ep.WINDOW_PORTS and ports_free((low, high))
    ephemeral = ephemeral_ports()
    if ephemeral is not None:
        assert high < ephemeral[0] or low > ephemeral[1]


def _free(_: PortRange) -> bool:
    return True
