"""vLLM's ZMQ KV event publisher, on the engine's event loop.

Like ``ZmqEventPublisher``: a PUB socket sends ``[topic, seq (8 bytes, big-endian),
payload]`` per batch, seq counting from 0 for this process; the PUB endpoint is bound when
it contains ``*`` or ``::`` or is ``ipc://``/``inproc://``, and connected otherwise; a ROUTER
on the replay endpoint (always bound) answers ``[identity, b"", start_seq]`` with every
buffered batch from ``start_seq`` on, then the end marker, in the reply format of the
configured vLLM version. The last ``buffer_steps`` batches are kept for replay.

For tests (``--sim-test-hooks``, llmgw.sim.engine.testhooks): `KvEventPublisher.drop_next`
makes the next batches go unsent on the PUB socket while they stay in the replay buffer, as
messages lost on the way (a subscriber sees a seq gap that a replay can fill); `dropped` and
`replayed_from` say what was dropped and which replays were asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

import zmq
import zmq.asyncio

from llmgw.kvcache import (
    Encoding,
    Event,
    KvEventDecodeError,
    KvEventEncodeError,
    decode_replay_request,
    encode_batch,
    encode_frames,
    encode_replay_message,
    parse_vllm_version,
    replay_end_frames,
)
from llmgw.sim.engine.config import KvEventsConfig
from llmgw.sim.engine.errors import SimStartError

log = logging.getLogger(__name__)

_REPLAY_HWM_FROM = (0, 33, 0)  # vLLM 0.33 sizes the ROUTER's SNDHWM to the buffer
_HOOK_HISTORY = 1000  # dropped seqs and replay requests remembered for the test hooks


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """PUB + replay ROUTER; use as ``async with``. Not thread-safe: one event loop."""

    def __init__(
        self,
        config: KvEventsConfig,
        *,
        encoding: Encoding,
        vllm_version: str,
        data_parallel_rank: int = 0,
    ) -> None:
        self.config = config
        self._encoding: Encoding = encoding
        self._version = vllm_version
        self._rank = data_parallel_rank
        self._topic = config.topic
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._drop = 0  # batches still to leave unsent (`drop_next`)
        self.dropped: deque[int] = deque(maxlen=_HOOK_HISTORY)  # seqs left unsent
        self.replayed_from: deque[int] = deque(maxlen=_HOOK_HISTORY)  # replays' start seqs
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint

    async def __aenter__(self) -> KvEventPublisher:
        try:
            self._open_pub()
            if self.config.replay_endpoint:
                self._open_router(self.config.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise SimStartError(f"cannot open the KV event sockets: {exc}") from exc
        if self._router is not None:
            self._replay_task = asyncio.create_task(self._serve_replay(), name="kv-replay")
        log.info("KV events: PUB %s, replay %s", self.endpoint, self.replay_endpoint)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        task, self._replay_task = self._replay_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.close()

    def close(self) -> None:
        """Close the sockets and the context (idempotent)."""
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if not self._ctx.closed:
            self._ctx.term()

    @property
    def next_seq(self) -> int:
        """The seq the next batch gets."""
        return self._seq

    @property
    def dropping(self) -> int:
        """Batches `drop_next` still leaves unsent."""
        return self._drop

    def drop_next(self, count: int) -> None:
        """A test's fault: the next ``count`` batches are buffered for replay but not sent."""
        if count < 0:
            raise ValueError(f"cannot drop {count} batches")
        self._drop += count

    def publish(self, events: Sequence[Event]) -> None:
        """Send one batch now and keep it for replay; a PUB send never blocks."""
        if self._pub is None or not events:
            return
        seq = self._seq  # taken before encoding, as vLLM does: a failed batch leaves a gap
        self._seq += 1
        try:
            payload = encode_batch(
                time.time(), events, self._rank, encoding=self._encoding, vllm_version=self._version
            )
        except KvEventEncodeError as exc:
            log.error("dropping KV event batch %d: %s", seq, exc)
            return
        self._buffer.append((seq, payload))
        if self._drop:
            self._drop -= 1
            self.dropped.append(seq)
            log.warning("KV event batch %d not sent: dropped by a test hook", seq)
            return
        try:
            self._pub.send_multipart(encode_frames(self._topic, seq, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            log.debug("KV event batch %d dropped at the high-water mark", seq)

    def _open_pub(self) -> None:
        # A plain socket on the same libzmq context: send_multipart stays synchronous.
        sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(self._ctx.underlying)
        pub: zmq.Socket[bytes] = sync_ctx.socket(zmq.PUB)
        self._pub = pub
        pub.set_hwm(self.config.hwm)
        if binds(self.config.endpoint):
            pub.bind(self.config.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self.config.endpoint)

    def _open_router(self, endpoint: str) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        self._router = router
        if parse_vllm_version(self._version) >= _REPLAY_HWM_FROM:
            router.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
        router.bind(endpoint)
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None  # the task only starts with a router
        while True:
            frames = await router.recv_multipart()
            try:
                identity, start_seq = decode_replay_request(frames)
            except KvEventDecodeError:
                log.warning("Invalid replay request: %s", frames)
                continue
            self.replayed_from.append(start_seq)
            await self._replay(router, identity, start_seq)

    async def _replay(self, router: zmq.asyncio.Socket, identity: bytes, start_seq: int) -> None:
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                frames = encode_replay_message(
                    self._topic, seq, payload, vllm_version=self._version
                )
                await router.send_multipart([identity, *frames])
        await router.send_multipart([identity, *replay_end_frames(vllm_version=self._version)])
