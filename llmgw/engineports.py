"""Engine port ranges: ``--engine-ports LO-HI``, and a window of free ports for one cluster.

The control server gives each engine shard the lowest free port of its range
(``llmgw.server.core.placement``), :data:`DEFAULT_ENGINE_PORTS` unless told otherwise. Every
cluster started on one host with the same range hands out the same ports first, so
clusters that run side by side (test runs, ``llmgw demo``, people's own) give each one a
window of its own with :func:`pick_window`: a random run of free ports that stays clear of

- the bottom of the default range, where clusters started with the defaults put their
  engines (:data:`WINDOW_SPAN` starts above it), and
- the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``): the ports
  ``bind(port 0)`` and outgoing connections take. An engine port there can be taken at any
  moment by a client's connection or by a test's "free port" before the engine binds it.

Windows start anywhere (not on a grid) and engines take the lowest ports of theirs first,
so two clusters that drew overlapping windows still meet only if their starts are closer
than the engines they run. Checking a window free at start catches clusters already up.

Imports nothing else of llmgw (the server, the CLI and the test harness all use it).

Exceptions::

    EnginePortsError        anything this module raises on purpose
    ├── PortRangeError      a range that is malformed, reversed, outside 1024–65535 or
    │                       smaller than two ports (also a ValueError); the message says which
    └── NoFreeWindow        no window of the size asked was free in the tries allowed
"""

from __future__ import annotations

import random
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

__all__ = [
    "DEFAULT_ENGINE_PORTS",
    "EPHEMERAL_PORTS_FILE",
    "WINDOW_PORTS",
    "WINDOW_SPAN",
    "EnginePortsError",
    "NoFreeWindow",
    "PortRange",
    "PortRangeError",
    "default_or_window",
    "ephemeral_ports",
    "format_port_range",
    "parse_port_range",
    "pick_window",
    "ports_free",
    "window_starts",
]

PortRange = tuple[int, int]
"""The first and the last port of a range, both included."""

DEFAULT_ENGINE_PORTS: Final[PortRange] = (20000, 29999)
LOWEST_PORT: Final = 1024  # below: privileged ports
HIGHEST_PORT: Final = 65535
FEWEST_PORTS: Final = 2  # a multi-node leader takes its engine port and a rendezvous port
WINDOW_PORTS: Final = 200
WINDOW_SPAN: Final[PortRange] = (21000, 59999)
"""Where windows are drawn (less the ephemeral range): above the first thousand ports of
the default range, which clusters started with the defaults fill from the bottom."""
EPHEMERAL_PORTS_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")

_RANGE = re.compile(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*")


class EnginePortsError(Exception):
    """Base of this module's exceptions."""


class PortRangeError(EnginePortsError, ValueError):
    """A port range that cannot be used; the message says why."""


class NoFreeWindow(EnginePortsError):
    """No window of the size asked was free in the tries allowed."""


def parse_port_range(text: str) -> PortRange:
    """``"LO-HI"`` as ``(LO, HI)``; PortRangeError when it is malformed, reversed, outside
    1024–65535 or has fewer than two ports."""
    match = _RANGE.fullmatch(text)
    if match is None:
        raise PortRangeError(f"{text!r} is not LO-HI (for example 20000-29999)")
    low, high = int(match[1]), int(match[2])
    if low > high:
        raise PortRangeError(f"{text!r}: the first port {low} is above the last {high}")
    if low < LOWEST_PORT or high > HIGHEST_PORT:
        raise PortRangeError(f"{text!r} is outside {LOWEST_PORT}-{HIGHEST_PORT}")
    if high - low + 1 < FEWEST_PORTS:
        raise PortRangeError(f"{text!r} has {high - low + 1} port; at least {FEWEST_PORTS}")
    return low, high


def format_port_range(ports: PortRange) -> str:
    """``(LO, HI)`` as ``"LO-HI"``, as :func:`parse_port_range` reads it."""
    return f"{ports[0]}-{ports[1]}"


def ephemeral_ports(path: Path = EPHEMERAL_PORTS_FILE) -> PortRange | None:
    """The kernel's ephemeral port range, or None where it cannot be read (not Linux)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def window_starts(span: PortRange, size: int, avoid: Sequence[PortRange]) -> list[PortRange]:
    """The first ports a window of ``size`` ports may start at: inside ``span`` and
    overlapping no range of ``avoid``, as ranges of starts (pure)."""
    starts = [(span[0], span[1] - size + 1)] if span[1] - span[0] + 1 >= size else []
    for low, high in avoid:  # a window starting in [low - size + 1, high] would overlap
        cut_low, cut_high = low - size + 1, high
        kept: list[PortRange] = []
        for first, last in starts:
            kept.extend(
                piece
                for piece in ((first, min(last, cut_low - 1)), (max(first, cut_high + 1), last))
                if piece[0] <= piece[1]
            )
        starts = kept
    return starts


def ports_free(ports: PortRange, host: str = "127.0.0.1") -> bool:
    """Every port of ``ports`` can be bound on ``host`` now (as engines bind: with
    SO_REUSEADDR, so a connection in TIME_WAIT does not count as taken)."""
    for port in range(ports[0], ports[1] + 1):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def pick_window(
    size: int = WINDOW_PORTS,
    *,
    span: PortRange = WINDOW_SPAN,
    avoid: Sequence[PortRange] = (),
    rng: random.Random | None = None,
    tries: int = 50,
    is_free: Callable[[PortRange], bool] = ports_free,
) -> PortRange:
    """A random window of ``size`` ports in ``span``, clear of ``avoid`` and of the
    ephemeral range, whose ports are all free now; NoFreeWindow after ``tries`` draws.

    Where the ephemeral range leaves no room in ``span`` it is not avoided: a window
    there beats none (the kernel's range differs between machines)."""
    if size < FEWEST_PORTS:
        raise PortRangeError(f"a window of {size} port; at least {FEWEST_PORTS}")
    ephemeral = ephemeral_ports()
    starts = window_starts(span, size, [*avoid, *([ephemeral] if ephemeral else [])])
    if not starts:
        starts = window_starts(span, size, avoid)
    if not starts:
        raise NoFreeWindow(f"no room for {size} ports in {format_port_range(span)}")
    rng = rng or random.Random()
    weights = [last - first + 1 for first, last in starts]
    for _ in range(tries):
        first, last = rng.choices(starts, weights)[0]
        start = rng.randint(first, last)
        window = (start, start + size - 1)
        if is_free(window):
            return window
    raise NoFreeWindow(
        f"no window of {size} free ports in {format_port_range(span)} in {tries} tries"
    )


def default_or_window(
    preferred: PortRange = DEFAULT_ENGINE_PORTS,
    size: int = WINDOW_PORTS,
    *,
    rng: random.Random | None = None,
    is_free: Callable[[PortRange], bool] = ports_free,
) -> PortRange:
    """``preferred`` when its first ``size`` ports are free (where engines of a cluster
    using it would go first), else a window of :func:`pick_window`."""
    bottom = (preferred[0], min(preferred[1], preferred[0] + size - 1))
    if is_free(bottom):
        return preferred
    return pick_window(size, rng=rng, is_free=is_free)
