"""``llmgw sim-engine``'s process: load, bind, serve, and stop like ``vllm serve``.

The HTTP port is bound only once the simulated load is over (connection refused while
loading, no 503 phase), after the KV event sockets. The process stays in the foreground,
logs to stderr and exits 0 on SIGTERM or SIGINT; ``--sim-fail-start`` exits 1 during the
load, ``--sim-crash-after N`` exits 1 after the Nth generation request, and ``--headless``
ranks serve nothing (like vLLM's worker nodes) until they are told to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from llmgw.kvcache import HashAlgorithmError
from llmgw.signals import stop_on_signals
from llmgw.sim.engine.api import SimServer
from llmgw.sim.engine.config import SimEngineConfig
from llmgw.sim.engine.core import EngineCore
from llmgw.sim.engine.errors import SimStartError
from llmgw.sim.engine.kvpublisher import KvEventPublisher
from llmgw.sim.engine.testhooks import kv_event_hooks

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1


@contextlib.asynccontextmanager
async def running_engine(config: SimEngineConfig) -> AsyncIterator[SimServer]:
    """The engine with its step loop and KV publisher running; ``.app`` is the ASGI app."""
    check_capacity(config)
    async with contextlib.AsyncExitStack() as stack:
        publisher: KvEventPublisher | None = None
        if config.enable_prefix_caching and config.kv_events.publishes:
            publisher = await stack.enter_async_context(
                KvEventPublisher(
                    config.kv_events,
                    encoding="map" if config.kv_event_encoding == "map" else "array",
                    vllm_version=config.vllm_version,
                )
            )
        try:
            engine = EngineCore(config, publish=publisher.publish if publisher else None)
        except HashAlgorithmError as exc:
            raise SimStartError(f"--prefix-caching-hash-algo: {exc}") from exc
        hooks = kv_event_hooks(publisher) if config.sim.test_hooks else None
        server = SimServer(engine, kv_endpoints=_endpoints_of(publisher), hooks=hooks)
        task = asyncio.create_task(engine.run(), name="sim-engine-core")
        task.add_done_callback(lambda done: _engine_exited(done, server))
        try:
            yield server
        finally:
            task.cancel()
            await asyncio.wait([task])  # its failure, if any, was logged when it ended


def _engine_exited(task: asyncio.Task[None], server: SimServer) -> None:
    if task.cancelled():
        return
    log.error("EngineCore encountered a fatal error", exc_info=task.exception())
    server.engine_died()


def _endpoints_of(publisher: KvEventPublisher | None) -> Callable[[], dict[str, Any]] | None:
    if publisher is None:
        return None
    return lambda: {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}


def check_capacity(config: SimEngineConfig) -> None:
    """vLLM refuses to start when one request of ``max_model_len`` cannot fit in the cache."""
    tokens = config.sim.num_kv_blocks * config.block_size
    if config.max_model_len > tokens:
        raise SimStartError(
            f"To serve at least one request with the models's max seq len "
            f"({config.max_model_len}), the KV cache needs "
            f"{-(-config.max_model_len // config.block_size)} blocks, more than the "
            f"{config.sim.num_kv_blocks} available (--sim-kv-blocks). Based on the available "
            f"memory, the estimated maximum model length is {tokens}. Try increasing "
            "--sim-kv-blocks or decreasing --max-model-len."
        )


async def serve(config: SimEngineConfig, stop: asyncio.Event | None = None) -> int:
    """Run until SIGTERM/SIGINT (or ``stop``); the process exit code."""
    stop = stop or asyncio.Event()
    crashed = asyncio.Event()
    with stop_on_signals(stop):
        _log_start(config)
        if config.parallel.headless:
            return await _headless(config, stop)
        if not await _load(config, stop):
            return EXIT_OK
        async with running_engine(config) as server:
            server.set_on_crash(crashed.set)
            with bind_listener(config.http.host, config.http.port) as listener:
                return await _serve_http(config, server, listener, stop, crashed)


async def _serve_http(
    config: SimEngineConfig,
    server: SimServer,
    listener: socket.socket,
    stop: asyncio.Event,
    crashed: asyncio.Event,
) -> int:
    web = _EmbeddedUvicorn(_uvicorn_config(config, server))
    host, port = listener.getsockname()[:2]
    web_task = asyncio.create_task(web.serve(sockets=[listener]), name="sim-http")
    log.info("Starting vLLM API server 0 on http://%s:%d", _host_text(host), port)
    waiters = [asyncio.create_task(e.wait()) for e in (stop, crashed)]
    try:
        await asyncio.wait([web_task, *waiters], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        web.should_exit = True
        web.force_exit = crashed.is_set()
        with contextlib.suppress(asyncio.CancelledError):
            await web_task
    if crashed.is_set():
        return EXIT_FAILED
    if not stop.is_set():
        raise SimStartError("the HTTP server stopped on its own")
    log.info("Shutting down the simulated engine")
    return EXIT_OK


async def _load(config: SimEngineConfig, stop: asyncio.Event) -> bool:
    """Sleep the simulated load time; False if told to stop meanwhile."""
    log.info("Loading model %s (simulated, %.1f s)", config.model, config.sim.load_s)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=config.sim.load_s)
    if stop.is_set():
        return False
    if config.sim.fail_start:
        raise SimStartError(
            "Engine core initialization failed: simulated start failure (--sim-fail-start)"
        )
    log.info(
        "Model loaded; %d KV cache blocks of %d tokens", config.sim.num_kv_blocks, config.block_size
    )
    return True


async def _headless(config: SimEngineConfig, stop: asyncio.Event) -> int:
    par = config.parallel
    log.info(
        "Headless node %d of %d: no API server; following %s:%d until stopped",
        par.node_rank,
        par.nnodes,
        par.master_addr,
        par.master_port,
    )
    await stop.wait()
    return EXIT_OK


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP listening socket (bound here, so a taken port is a clear start error)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SimStartError(f"cannot listen on {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise SimStartError(f"cannot listen on {host}:{port}: {exc}") from exc
    return sock


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: this process handles signals once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _uvicorn_config(config: SimEngineConfig, server: SimServer) -> uvicorn.Config:
    return uvicorn.Config(
        server.app,
        lifespan="off",
        access_log=config.http.access_log,
        log_level=config.http.uvicorn_log_level,
        log_config=None,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _log_start(config: SimEngineConfig) -> None:
    par = config.parallel
    log.info("vLLM API server version %s (llmgw simulated engine)", config.vllm_version)
    log.info(
        "model=%s served_model_name=%s tp=%d pp=%d nnodes=%d node_rank=%d block_size=%d "
        "prefix_caching=%s hash_algo=%s kv_events=%s",
        config.model,
        list(config.served_model_names),
        par.tensor_parallel_size,
        par.pipeline_parallel_size,
        par.nnodes,
        par.node_rank,
        config.block_size,
        config.enable_prefix_caching,
        config.prefix_caching_hash_algo,
        config.kv_events.publishes,
    )
    if config.kv_events.enable_kv_cache_events and not config.enable_prefix_caching:
        log.warning("KV cache events are on but prefix caching is off: no events will be sent")
