"""The HTTP benchmark's server mode ``_serve``: one ASGI server around the real control service."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.httpkit.settings import (
    CHALLENGERS,
    FIXTURE,
    HYPERCORN_KEEPALIVE_REQUESTS,
    MAX_MESSAGE_BYTES,
)
from bench.kit import HOST

# ======================================================================================
# Server mode `_serve`: one ASGI server around the real control service
# ======================================================================================


def parse_serve(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.http _serve")
    p.add_argument("--server", choices=("uvicorn", *CHALLENGERS), required=True)
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--nodes", type=int, default=2)
    return p.parse_args(argv)


async def build_app(store: Any, nodes: int) -> Any:
    """The gRPC-web app as ``llmgw server`` builds it, with ``nodes`` registered nodes."""
    from llmgw.agent.discovery import simulated_node
    from llmgw.server.state.inventory import InventoryConfig
    from llmgw.server.state.plane import ControlPlane
    from llmgw.server.state.store import now_ms
    from llmgw.server.wire.controlsvc import ControlService
    from llmgw.server.wire.grpcweb import GrpcWebApp

    # A grace longer than any run keeps the nodes READY, as if they were heartbeating.
    plane = ControlPlane(store, InventoryConfig(grace_s=10.0 * 24 * 3600))
    for i in range(nodes):
        node = simulated_node(FIXTURE, node_id=f"n{i}", hostname=f"n{i}.bench")
        plane.inventory.register(node, 1, peer="bench", now_ms=now_ms(), now_mono=time.monotonic())
    return GrpcWebApp(services=[ControlService(plane)], max_message_bytes=MAX_MESSAGE_BYTES)


def listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


async def serve_uvicorn(app: Any, sock: socket.socket, stop: asyncio.Event) -> None:
    import uvicorn

    class Embedded(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # this process handles the signals
            yield

    config = uvicorn.Config(
        app,
        http="httptools",
        loop="uvloop",
        ws="none",
        lifespan="off",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=2,
    )
    server = Embedded(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopper.cancel()
    await task


async def serve_hypercorn(app: Any, sock: socket.socket, stop: asyncio.Event) -> None:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.keep_alive_max_requests = HYPERCORN_KEEPALIVE_REQUESTS
    config.graceful_timeout = 2
    await serve(app, config, shutdown_trigger=stop.wait, mode="asgi")


async def serve_llmgw(app: Any, stop: asyncio.Event) -> None:
    from llmgw.gateway.httplimits import ServerLimits
    from llmgw.gateway.httpserver import HttpServer
    from llmgw.server.wire.asgihttp import AsgiHandler
    from llmgw.server.wire.grpcweb import most_body_bytes

    limits = ServerLimits(max_body_bytes=most_body_bytes(MAX_MESSAGE_BYTES))  # as llmgw server
    server = HttpServer(AsgiHandler(app), limits)
    _, port = await server.start(HOST, 0)
    print(f"PORT {port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


async def run_serve(args: argparse.Namespace) -> None:
    from llmgw.server.state.store import Store

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with Store(args.db) as store:
        app = await build_app(store, args.nodes)
        if args.server == "llmgw":
            await serve_llmgw(app, stop)
            return
        sock = listening_socket()
        print(f"PORT {sock.getsockname()[1]}", flush=True)
        if args.server == "uvicorn":
            await serve_uvicorn(app, sock, stop)
        else:
            await serve_hypercorn(app, sock, stop)
