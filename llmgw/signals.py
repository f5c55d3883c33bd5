"""Stopping a process's event loop on SIGINT and SIGTERM, shared by every long-running
command (server, agent, gateway, simulated engine); imports nothing else of llmgw."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """Set ``stop`` on SIGINT or SIGTERM while the block runs (on the running loop), and
    give the signals back to their previous handling after it."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
