"""A simulated vLLM for the gateway's tests: ``llmgw sim-engine serve`` run in the test's
own event loop on a free loopback port, ready at once (``--sim-load-seconds 0``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from llmgw.addresses import free_port
from llmgw.cli.main import build_parser
from llmgw.cli.simengine import config_from_args
from llmgw.sim.engine import serve

NO_TIME = ("--sim-prefill-ms-per-token", "0", "--sim-decode-ms-per-token", "0")
"""Flags of an engine that answers at once: no prefill or decode time."""


async def wait_listening(port: int) -> None:
    """Return once something accepts connections on ``port``; fail after about 5 s."""
    for _ in range(250):
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await writer.wait_closed()
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"nothing listens on {port}")


@contextlib.asynccontextmanager
async def sim_engine(model: str, *flags: str) -> AsyncIterator[str]:
    """``llmgw sim-engine serve MODEL FLAGS…`` listening on a free port; its URL. It must
    stop cleanly (exit status 0) when the block ends."""
    port = free_port()
    args = build_parser().parse_args(
        ["sim-engine", "serve", model, "--port", str(port), "--sim-load-seconds", "0", *flags]
    )
    stop = asyncio.Event()
    engine = asyncio.create_task(serve(config_from_args(args, {}), stop))
    try:
        await wait_listening(port)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        assert await engine == 0
