"""KV cache events from this node's engines, mirrored and sent up the agent's stream.

For each shard whose engine publishes KV events (``LaunchSpec.kv_events``), an
`EngineSubscriber` connects a SUB to the engine's ``ipc://`` PUB endpoint (the engine binds,
the agent connects; spec/vllm-kv-events.md §2) and, for replay, a DEALER to its ROUTER. It
keeps a `BlockMirror` per data-parallel rank. Sequence numbers (one stream per publisher,
which vLLM gives each DP rank) are checked batch by batch:

* **Start, and after an engine restart**: live batches are held while a replay from seq 0
  fetches everything the engine still buffers; then the replayed and held batches are
  applied in seq order. Blocks cached before the buffer's oldest batch stay unknown.
* **A gap** (seq jumps ahead): replay from the first missing seq while live batches wait,
  then apply both in order. A hole replay cannot fill (the buffer moved on, the replay timed
  out, too many batches held, a batch vLLM never sent) resets the engine's blocks: the
  mirror starts again from the next batch, and upstream forgets what it had.
* **An engine restart** (the SUB's connection drops, or seq goes back) and
  ``AllBlocksCleared`` reset the engine's blocks the same way.
* **A malformed message** is counted and logged (at most one warning per
  ``error_log_interval_s``) and skipped; the subscriber keeps going.

What an engine can cost the agent is bounded: ZMQ drops a connection whose message part
passes ``max_message_bytes`` before reading it (the SUB then reconnects and syncs again,
resetting the engine's blocks), live and replayed batches held during a replay are bounded
in count and bytes, and a mirror holds at most the engine's own block count: a
``BlockStored`` that leaves more is a decode error that resets the mirror. The shard's
runner reads the count once the engine is READY (``vllm:cache_config_info`` on its
``/metrics``, `llmgw.agent.probe.parse_kv_blocks`) and the supervisor hands it to
`KvEventHub.cap`; until then, and for an engine that does not tell it, the fixed
``max_blocks`` bounds each mirror (it is also the most a cap may be). A mirror already
holding more than a new cap resets the same way. (Blocks that outlive their eviction in a
mirror, as ``kv_cache_report_mode="full"`` makes them, `llmgw.kvcache.mirror`, thus end in a
reset once they pass the engine's count.) The socket folders must be the agent's alone
(`llmgw.agent.ipcdir.check_private_dir`) before the subscriber connects: whoever could bind
a socket there would feed the agent their blocks.

`llmgw.agent.kvhub` holds the subscribers of every followed engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.errors import SocketFolderError
from llmgw.agent.ipcdir import check_private_dir
from llmgw.kvcache import (
    KvEventDecodeError,
    MirrorOverflowError,
    decode_batch,
    decode_frames,
    decode_replay_message,
)
from llmgw.kvcache import encode_replay_request as replay_request
from llmgw.kvcache.mirror import BlockMirror

__all__ = ["EngineSubscriber", "KvEventCounters", "KvFollowConfig"]

log = logging.getLogger(__name__)

_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_DRAIN_LIMIT = 1000  # messages read per wake-up, so one busy socket cannot starve the rest
_RETRY_S = 1.0  # after an unexpected error, before the sockets are opened again
MAX_DATA_PARALLEL_RANK = 4095  # each rank costs a mirror; the server refuses higher ones too


@dataclass(frozen=True, slots=True)
class KvFollowConfig:
    """How the agent follows its engines' KV events; durations in seconds."""

    flush_interval_s: float = 0.03  # net changes are batched this long before they are sent
    replay_timeout_s: float = 2.0  # silence on the replay socket that ends a replay
    max_held_batches: int = 10_000  # live batches held during a replay (and replayed ones)
    full_copy_chunk: int = 32_768  # block hashes per KvDelta message
    compute_keys: bool = True  # keep our own block keys (llmgw.kvcache.mirror)
    error_log_interval_s: float = 10.0  # at most one decode-error warning per interval
    # One message part: a batch is one engine step's events, ~5 bytes per token id and ~10
    # per block hash, so 16 MiB holds a step of over 3 million tokens. ZMQ drops the
    # connection of a longer message before buffering it (the subscriber then syncs again).
    max_message_bytes: int = 16 * 2**20
    max_held_bytes: int = 256 * 2**20  # payloads held during a replay, live and replayed
    # Blocks in one mirror (one engine's data-parallel rank) until the engine's own count is
    # known (KvEventHub.cap, once it is READY), and the most a cap may be: more than an engine
    # caches. vLLM's num_gpu_blocks is ~65k for an 8B model on a 141 GB GPU and ~10**6 for a
    # tiny model there; CPU offloading tiers add theirs. More is a decode error: the mirror
    # resets.
    max_blocks: int = 2**23


@dataclass(frozen=True, slots=True)
class KvEventCounters:
    """What one engine's subscriber has seen (a snapshot, for metrics and tests)."""

    batches: int = 0  # event batches applied
    events: int = 0  # events in them
    gaps: int = 0  # seq gaps on the live stream
    replays: int = 0  # replays requested (start, restart, gap)
    replay_failures: int = 0  # holes no replay could fill
    resets: int = 0  # the engine's blocks reset (hole, restart, AllBlocksCleared)
    restarts: int = 0  # engine restarts noticed (connection dropped, seq went back)
    decode_errors: int = 0  # malformed frames, payloads, replay messages; a mirror overflow
    blocks: int = 0  # blocks mirrored now, all ranks
    last_seq: int | None = None  # the last batch applied


@dataclass(slots=True)
class _Counts:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resets: int = 0
    restarts: int = 0
    decode_errors: int = 0


@dataclass(slots=True)
class _Replay:
    """A replay in progress: its DEALER and what it returned so far."""

    dealer: zmq.asyncio.Socket
    from_seq: int
    last_heard: float
    batches: list[tuple[int, bytes]] = field(default_factory=list)


class _Throttled:
    """Warnings at most once per interval; the rest at DEBUG, counted in the next warning."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next_at = 0.0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next_at:
            self._suppressed += 1
            log.debug(message, *args)
            return
        if self._suppressed:
            message += " (and %d more since the last warning)"
            args = (*args, self._suppressed)
        log.warning(message, *args)
        self._suppressed, self._next_at = 0, now + self._interval_s


class EngineSubscriber:
    """One engine's KV events → its mirrors, one per data-parallel rank."""

    def __init__(
        self,
        shard_id: str,
        endpoints: KvEventEndpoints,
        *,
        ctx: zmq.asyncio.Context,
        config: KvFollowConfig,
        on_change: Callable[[], None],
    ) -> None:
        self.shard_id = shard_id
        self.endpoints = endpoints
        self.config = config
        self.mirrors: dict[int, BlockMirror] = {}
        self.last_seq: int | None = None
        self.max_blocks = config.max_blocks  # per mirror; `cap` lowers it to the engine's
        self._ctx = ctx
        self._on_change = on_change
        self._counts = _Counts()
        self._errors = _Throttled(config.error_log_interval_s)
        self._next: int | None = None  # the seq expected next; None until synced
        self._connected = False  # between the SUB's CONNECTED and DISCONNECTED events
        self._held: list[tuple[int, bytes]] = []
        self._held_bytes = 0  # of the payloads in ``_held`` and the replay's batches
        self._replay: _Replay | None = None
        self._poller = zmq.asyncio.Poller()

    def counters(self) -> KvEventCounters:
        c = self._counts
        blocks = sum(len(m) for m in self.mirrors.values())
        return KvEventCounters(
            c.batches, c.events, c.gaps, c.replays, c.replay_failures, c.resets, c.restarts,
            c.decode_errors, blocks, self.last_seq,
        )  # fmt: skip

    def cap(self, blocks: int) -> None:
        """Bound each mirror, now and of ranks still to come, at ``blocks`` (the engine's own
        count; at most ``config.max_blocks``). A mirror already holding more resets, as an
        overflow would: a decode error, one warning for all of them."""
        self.max_blocks = max(1, min(blocks, self.config.max_blocks))
        over = {rank: len(m) for rank, m in self.mirrors.items() if len(m) > self.max_blocks}
        for mirror in self.mirrors.values():
            mirror.max_blocks = self.max_blocks
        if not over:
            return
        for rank in over:
            self.mirrors[rank].reset()
        self._counts.decode_errors += len(over)
        self._counts.resets += len(over)
        held = ", ".join(f"rank {rank}: {count}" for rank, count in sorted(over.items()))
        log.warning("shard %s: KV events: mirrors hold more than the engine's %d blocks (%s); "
                    "resetting them", self.shard_id, self.max_blocks, held)  # fmt: skip
        self._on_change()

    async def run(self) -> None:
        """Follow the engine until cancelled; an unexpected error reopens the sockets."""
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except SocketFolderError as exc:
                self._errors.warning("shard %s: not following KV events: %s", self.shard_id, exc)
                await asyncio.sleep(_RETRY_S)
            except Exception:  # a bug or a socket error: never take the agent down
                log.exception("shard %s: KV event subscriber failed; reopening", self.shard_id)
                self._lost_track("the subscriber failed")
                await asyncio.sleep(_RETRY_S)

    async def _follow(self) -> None:
        for path in self.endpoints.socket_paths:
            check_private_dir(path.parent)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic.encode())
        monitor = sub.get_monitor_socket(_MONITORED)
        self._connected = False
        self._poller = zmq.asyncio.Poller()
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(monitor, zmq.POLLIN)
        try:
            sub.connect(self.endpoints.endpoint)
            while True:
                ready = dict(await self._poller.poll(self._poll_timeout_ms()))
                if monitor in ready:
                    await self._drain_monitor(monitor, sub)
                if sub in ready:
                    await self._drain(sub)
                await self._after_poll(ready)
        finally:
            self._end_replay()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _poll_timeout_ms(self) -> int | None:
        if self._replay is None:
            return None
        left = self._replay.last_heard + self.config.replay_timeout_s - time.monotonic()
        return max(1, int(left * 1000))

    async def _after_poll(self, ready: dict[zmq.asyncio.Socket, int]) -> None:
        replay = self._replay
        if replay is None:
            return
        if replay.dealer in ready:
            await self._drain_replay(replay)
        if self._replay is replay and self._replay_overdue(replay):
            self._errors.warning(
                "shard %s: replay from seq %d timed out", self.shard_id, replay.from_seq
            )
            await self._complete_replay()

    def _replay_overdue(self, replay: _Replay) -> bool:
        return time.monotonic() - replay.last_heard >= self.config.replay_timeout_s

    # -- the live stream --------------------------------------------------------------------

    async def _drain_monitor(self, monitor: zmq.asyncio.Socket, sub: zmq.asyncio.Socket) -> None:
        """Every pending connection event: the poll reports a socket once, not per message."""
        while True:
            try:
                frames = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_monitor(frames, sub)

    async def _on_monitor(self, frames: list[bytes], sub: zmq.asyncio.Socket) -> None:
        event = parse_monitor_message(frames)["event"]
        log.debug("shard %s: KV event socket: %s", self.shard_id, event)
        if event == zmq.EVENT_DISCONNECTED:
            self._connected = False
            self._counts.restarts += 1
            self._lost_track("its engine went away")
            self._redial(sub)
        elif event == zmq.EVENT_CONNECTED:
            self._connected = True
            if self._next is None and self._replay is None and self.endpoints.replay_endpoint:
                await self._start_replay(0)  # what it published before we joined

    def _redial(self, sub: zmq.asyncio.Socket) -> None:
        """Connect again. ZMQ reconnects after the peer went away, but never after a
        protocol error, and a message part over ``max_message_bytes`` is one."""
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: ZMQ already dropped the endpoint
            sub.disconnect(self.endpoints.endpoint)
        sub.connect(self.endpoints.endpoint)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(_DRAIN_LIMIT):
            try:
                frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            await self._on_live(frames)

    async def _on_live(self, frames: Sequence[bytes]) -> None:
        try:
            topic, seq, payload = decode_frames(frames)
        except KvEventDecodeError as exc:
            self._bad("a message", exc)
            return
        if topic != self.endpoints.topic:
            return  # another topic that shares our prefix
        if not self._connected:
            return  # read after its engine went away: the next replay from 0 has what counts
        if self._replay is not None:
            await self._hold(seq, payload)
        elif self._next is None or seq < self._next:
            if self._next is not None:  # seq went back: a new engine process
                self._counts.restarts += 1
                self._lost_track(f"seq went back from {self._next - 1} to {seq}")
            await self._sync_from(0, seq, payload)
        elif seq > self._next:
            self._counts.gaps += 1
            log.info("shard %s: KV events %d..%d missed; replaying", self.shard_id,
                     self._next, seq - 1)  # fmt: skip
            await self._sync_from(self._next, seq, payload)
        else:
            self._apply(seq, payload)

    async def _sync_from(self, from_seq: int, seq: int, payload: bytes) -> None:
        """Replay from ``from_seq``, holding the live batch ``seq`` (applied at once without
        a replay socket; a gap then resets)."""
        if self.endpoints.replay_endpoint:
            await self._hold(seq, payload)
            if self._replay is None:
                await self._start_replay(from_seq)
            return
        self._accept(seq, payload)

    async def _hold(self, seq: int, payload: bytes) -> None:
        self._held.append((seq, payload))
        self._held_bytes += len(payload)
        if self._holding_too_much(len(self._held)):
            self._errors.warning("shard %s: replay too slow: %d live batches held",
                                 self.shard_id, len(self._held))  # fmt: skip
            await self._complete_replay()

    def _holding_too_much(self, batches: int) -> bool:
        config = self.config
        return batches > config.max_held_batches or self._held_bytes > config.max_held_bytes

    # -- replay -----------------------------------------------------------------------------

    async def _start_replay(self, from_seq: int) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        dealer.connect(self.endpoints.replay_endpoint)
        self._replay = _Replay(dealer, from_seq, time.monotonic())
        self._poller.register(dealer, zmq.POLLIN)
        self._counts.replays += 1
        log.debug("shard %s: replaying KV events from seq %d", self.shard_id, from_seq)
        await dealer.send_multipart(replay_request(from_seq))

    async def _drain_replay(self, replay: _Replay) -> None:
        for _ in range(_DRAIN_LIMIT):
            try:
                frames = await replay.dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            replay.last_heard = time.monotonic()
            try:
                message = decode_replay_message(frames)
            except KvEventDecodeError as exc:
                self._bad("a replay message", exc)
                continue
            if message.is_end:
                await self._complete_replay(ended=True)
                return
            replay.batches.append((message.seq, message.payload))
            self._held_bytes += len(message.payload)
            if self._holding_too_much(len(replay.batches)):
                self._errors.warning("shard %s: replay longer than %d batches; cut short",
                                     self.shard_id, self.config.max_held_batches)  # fmt: skip
                await self._complete_replay()
                return

    async def _complete_replay(self, *, ended: bool = False) -> None:
        """Apply what the replay returned and what was held, in seq order; holes reset.

        ``ended``: the end marker came. An engine that has published nothing yet answers
        a replay from seq N with the marker alone: its next batch is N. A hole after the
        last batch the replay returned was lost after the replay was answered: another
        replay fetches it (each one moves the expected seq on, so this ends).
        """
        replay = self._end_replay()
        replayed = dict(replay.batches if replay is not None else ())
        batches = dict(replayed)
        for seq, payload in self._held:
            batches.setdefault(seq, payload)
        self._held, self._held_bytes = [], 0
        if not batches and ended and replay is not None and self._next is None:
            self._next = replay.from_seq
        covered = max(replayed, default=-1)
        order = sorted(batches)
        for i, seq in enumerate(order):
            expected = self._next
            if ended and replayed and expected is not None and covered < expected < seq:
                self._counts.gaps += 1
                self._held = [(s, batches[s]) for s in order[i:]]
                self._held_bytes = sum(len(payload) for _, payload in self._held)
                await self._start_replay(expected)
                return
            self._accept(seq, batches[seq])

    def _end_replay(self) -> _Replay | None:
        replay, self._replay = self._replay, None
        if replay is not None:
            with contextlib.suppress(KeyError):
                self._poller.unregister(replay.dealer)
            replay.dealer.close(linger=0)
        return replay

    # -- applying ---------------------------------------------------------------------------

    def _accept(self, seq: int, payload: bytes) -> None:
        """Apply a batch in seq order: a repeat is skipped, a hole first resets."""
        if self._next is not None:
            if seq < self._next:
                return
            if seq > self._next:
                self._counts.replay_failures += 1
                log.warning("shard %s: KV events %d..%d are lost; resetting its blocks",
                            self.shard_id, self._next, seq - 1)  # fmt: skip
                self._reset()
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._next = seq + 1
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError as exc:
            self._bad(f"batch {seq}", exc)
            return
        rank = batch.data_parallel_rank or 0
        if not 0 <= rank <= MAX_DATA_PARALLEL_RANK:
            error = f"data_parallel_rank {rank} is outside 0..{MAX_DATA_PARALLEL_RANK}"
            self._bad(f"batch {seq}", KvEventDecodeError(error))
            return
        mirror = self.mirrors.get(rank)
        if mirror is None:
            mirror = self.mirrors[rank] = BlockMirror(
                compute_keys=self.config.compute_keys, max_blocks=self.max_blocks
            )
        clears = mirror.clears
        try:
            mirror.apply(batch)
        except MirrorOverflowError as exc:
            self._bad(f"batch {seq}", exc)
            mirror.reset()
            self._counts.resets += 1
            self._on_change()
            return
        self._counts.resets += mirror.clears - clears
        self._counts.batches += 1
        self._counts.events += len(batch.events)
        self.last_seq = seq
        self._on_change()

    def _lost_track(self, why: str) -> None:
        """The engine's history is unknown from here: reset, and sync again on its next word."""
        log.info("shard %s: %s; resetting its KV blocks", self.shard_id, why)
        self._end_replay()
        self._held, self._held_bytes = [], 0
        self._next = self.last_seq = None
        self._reset()

    def _reset(self) -> None:
        if not self.mirrors:
            return
        for mirror in self.mirrors.values():
            mirror.reset()
        self._counts.resets += 1
        self._on_change()

    def _bad(self, what: str, exc: KvEventDecodeError) -> None:
        self._counts.decode_errors += 1
        self._errors.warning("shard %s: KV events: %s skipped: %s", self.shard_id, what, exc)
