"""The one worker that follows ``Watch``: frozen snapshots out, reconnecting forever.

``WatchSession.run(sink)`` keeps a ``ClusterModel`` (``llmgw.tui.model``) fed from the
server's Watch stream and hands the console a ``ConsoleSnapshot`` at most every
``frame_s`` (events arrive in bursts: a heartbeat round is one event per node). It never
returns on a disconnect: the link's ``LinkStatus`` goes STALE, the data stay as they were,
and attempts to reconnect follow a jittered, capped exponential backoff (``Retry``); the
first snapshot of a new stream replaces the model and the link is LIVE again.

A stream is healthy when quiet (nothing changed), so it has no read timeout; instead an
idle watchdog asks the server something small after ``idle_s`` without an event and breaks
the stream when there is no answer (a peer that vanished without closing the connection).
Router statistics are polled beside the stream (``GetRouterStats``); a server that does not
implement it yet is asked again only every ``router_unavailable_every_s``.

Failures are logged once per streak at WARNING (the first), then at DEBUG. The only
exceptions handled are the client's (``llmgw.client.errors``), plus ``_ServerSilent``, a
``ClientError`` of this module's own that the watchdog raises to break a silent stream.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

from grpclib.const import Status

from llmgw.api.llmgw.v1 import WatchEvent
from llmgw.client import ClientError, ControlClient, RpcError, ServerUnreachable
from llmgw.tui.model import ClusterModel, ConsoleSnapshot

__all__ = [
    "ALLOWED_TRANSITIONS",
    "Backoff",
    "Feed",
    "FeedSink",
    "LinkPhase",
    "LinkStatus",
    "Retry",
    "WatchConfig",
    "WatchSession",
    "fetch_snapshot",
    "wall_clock_ms",
]

log = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class LinkPhase(enum.Enum):
    """Where the console's link to the server stands."""

    CONNECTING = "connecting"  # the first attempt; nothing received yet
    LIVE = "live"  # the stream is open and its snapshot arrived: the data are current
    STALE = "stale"  # the stream broke; the data are as they were, waiting to retry
    RECONNECTING = "reconnecting"  # attempt n to open the stream again is under way


ALLOWED_TRANSITIONS: Final[Mapping[LinkPhase, frozenset[LinkPhase]]] = {
    LinkPhase.CONNECTING: frozenset({LinkPhase.LIVE, LinkPhase.STALE}),
    LinkPhase.LIVE: frozenset({LinkPhase.STALE}),
    LinkPhase.STALE: frozenset({LinkPhase.RECONNECTING}),
    LinkPhase.RECONNECTING: frozenset({LinkPhase.LIVE, LinkPhase.STALE}),
}


@dataclass(frozen=True, slots=True)
class LinkStatus:
    """The link's phase with what the badge needs; ``live_at`` is monotonic seconds."""

    phase: LinkPhase = LinkPhase.CONNECTING
    attempt: int = 0  # reconnection attempts in this outage (0 while LIVE)
    live_at: float | None = None  # when the data were last known current; None: never
    error: str = ""  # why the link is not LIVE, in words

    def to(self, phase: LinkPhase, **changes: object) -> LinkStatus:
        """The next status; ValueError for a transition ALLOWED_TRANSITIONS does not list."""
        if phase not in ALLOWED_TRANSITIONS[self.phase]:
            raise ValueError(f"link cannot go from {self.phase.name} to {phase.name}")
        return replace(self, phase=phase, **changes)  # type: ignore[arg-type]

    @property
    def live(self) -> bool:
        return self.phase is LinkPhase.LIVE

    def stale_for(self, now: float) -> float | None:
        """Seconds since the data were last current; None while LIVE or never current."""
        if self.live or self.live_at is None:
            return None
        return max(0.0, now - self.live_at)

    def badge(self, now: float) -> str:
        """``LIVE``, ``STALE 12s`` (``· 3 retries`` once it has retried), ``RECONNECTING #4``
        (while attempt 4 is under way) or ``CONNECTING``."""
        if self.phase is LinkPhase.STALE:
            age = self.stale_for(now)
            text = "STALE" if age is None else f"STALE {age:.0f}s"
            if self.attempt:
                text += f" · {self.attempt} {'retry' if self.attempt == 1 else 'retries'}"
            return text
        if self.phase is LinkPhase.RECONNECTING:
            return f"RECONNECTING #{self.attempt}"
        return self.phase.name


@dataclass(frozen=True, slots=True)
class Backoff:
    """Jittered, capped exponential delays: attempt n waits about first·factorⁿ⁻¹."""

    first_s: float = 0.5
    factor: float = 2.0
    max_s: float = 15.0
    jitter: float = 0.2  # each delay is scaled by a random factor in [1-jitter, 1+jitter]

    def delay(self, attempt: int, rand: float) -> float:
        """The wait before ``attempt`` (1-based), ``rand`` uniform in [0, 1)."""
        base = min(self.max_s, self.first_s * self.factor ** max(0, attempt - 1))
        return min(self.max_s, base * (1 - self.jitter + 2 * self.jitter * rand))


class Retry:
    """An async iterator of attempt numbers, sleeping the backoff's delay before each."""

    def __init__(
        self,
        backoff: Backoff,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._backoff = backoff
        self._sleep = sleep
        self._rand = rand
        self.attempt = 0

    def __aiter__(self) -> AsyncIterator[int]:
        return self

    async def __anext__(self) -> int:
        self.attempt += 1
        await self._sleep(self._backoff.delay(self.attempt, self._rand()))
        return self.attempt

    def reset(self) -> None:
        self.attempt = 0


class _ServerSilent(ClientError):
    """No Watch event for a while and no answer to a probe: the link is considered broken."""


class FeedSink(Protocol):
    """What the console gives the worker: where snapshots and link changes go."""

    def snapshot_ready(self, snapshot: ConsoleSnapshot) -> None: ...

    def status_changed(self, status: LinkStatus) -> None: ...


class Feed(Protocol):
    """A source of snapshots for the console: ``WatchSession``, or a benchmark's fake."""

    async def run(self, sink: FeedSink) -> None: ...


@dataclass(frozen=True, slots=True)
class WatchConfig:
    """Seconds, all explicit."""

    backoff: Backoff = field(default_factory=Backoff)
    frame_s: float = 0.2  # at most one snapshot this often
    idle_s: float = 15.0  # no event for this long: probe the server
    router_every_s: float = 2.0  # GetRouterStats this often while LIVE
    router_unavailable_every_s: float = 30.0  # … and this often when it is not implemented


class WatchSession:
    """Follows Watch for the console, forever; see the module docstring."""

    def __init__(
        self,
        client: ControlClient,
        config: WatchConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = wall_clock_ms,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._client = client
        self._config = config or WatchConfig()
        self._clock = clock
        self._wall_ms = wall_ms
        self._rand = rand
        self.model = ClusterModel()
        self.status = LinkStatus()
        self._sink: FeedSink | None = None
        self._wake = asyncio.Event()
        self._last_event = 0.0
        self._failures = 0  # in the current streak, for logging once at WARNING

    async def run(self, sink: FeedSink) -> None:
        """Follow Watch until cancelled; never returns on its own."""
        self._sink = sink
        sink.status_changed(self.status)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._publish_loop(sink), name="console-publish")
            tasks.create_task(self._router_loop(), name="console-router-stats")
            tasks.create_task(self._link_loop(), name="console-watch")

    # --- the stream --------------------------------------------------------------------

    async def _link_loop(self) -> None:
        retry = Retry(self._config.backoff, rand=self._rand)
        while True:
            try:
                await self._follow_guarded(retry)
                error = "the server closed the stream"
            except asyncio.CancelledError:
                raise
            except ClientError as exc:
                error = str(exc)
            self._broken(error)
            attempt = await anext(retry)
            self._set(self.status.to(LinkPhase.RECONNECTING, attempt=attempt))

    async def _follow_guarded(self, retry: Retry) -> None:
        """Follow one stream, breaking it when the idle watchdog finds the server silent."""
        self._last_event = self._clock()
        follow = asyncio.create_task(self._follow(retry), name="console-watch-stream")
        try:
            while not follow.done():
                await asyncio.wait({follow}, timeout=self._config.idle_s / 2)
                if not follow.done() and self._clock() - self._last_event > self._config.idle_s:
                    await self._probe()
                    self._last_event = self._clock()
            follow.result()
        finally:
            if not follow.done():
                follow.cancel()
                await asyncio.wait({follow})

    async def _follow(self, retry: Retry) -> None:
        stream = self._client.watch()
        try:
            async for event in stream:
                self._on_event(event, retry)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    def _on_event(self, event: WatchEvent, retry: Retry) -> None:
        self._last_event = self._clock()
        self.model.apply(event, self._wall_ms())
        if not self.status.live:
            self._set(self.status.to(LinkPhase.LIVE, attempt=0, error=""))
            retry.reset()
            if self._failures:
                log.info("console: watching the control server again")
            self._failures = 0
        self._wake.set()

    async def _probe(self) -> None:
        """Raise _ServerSilent unless the server answers a small call."""
        silent = f"no event for {self._config.idle_s:g}s and no answer"
        try:
            await self._client.get_router_stats()
        except RpcError as exc:
            if exc.status in (Status.DEADLINE_EXCEEDED, Status.UNAVAILABLE):
                raise _ServerSilent(f"{silent}: {exc}") from exc
        except ServerUnreachable as exc:
            raise _ServerSilent(f"{silent}: {exc}") from exc

    def _broken(self, error: str) -> None:
        self._failures += 1
        level = logging.WARNING if self._failures == 1 else logging.DEBUG
        log.log(level, "console: the watch stream broke: %s", error)
        live_at = self._clock() if self.status.live else self.status.live_at
        self._set(self.status.to(LinkPhase.STALE, error=error, live_at=live_at))

    def _set(self, status: LinkStatus) -> None:
        self.status = status
        if self._sink is not None:
            self._sink.status_changed(status)

    # --- snapshots and router statistics -----------------------------------------------

    async def _publish_loop(self, sink: FeedSink) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            sink.snapshot_ready(self.model.snapshot(self._wall_ms()))
            await asyncio.sleep(self._config.frame_s)

    async def _router_loop(self) -> None:
        while True:
            wait = self._config.router_every_s
            if self.status.live:
                wait = await self._poll_router()
            await asyncio.sleep(wait)

    async def _poll_router(self) -> float:
        """Ask for router statistics once; returns how long to wait before asking again."""
        try:
            stats = await self._client.get_router_stats()
        except RpcError as exc:
            if exc.status in (Status.UNIMPLEMENTED, Status.FAILED_PRECONDITION):
                self.model.router_unavailable(f"no router stats yet: {exc.message or exc}")
                self._wake.set()
                return self._config.router_unavailable_every_s
            self.model.router_unavailable(f"router stats failed: {exc}")
        except ClientError as exc:  # unreachable: the link's status says so already
            log.debug("console: router stats: %s", exc)
        else:
            self.model.add_router_stats(stats, self._clock())
        self._wake.set()
        return self._config.router_every_s


async def fetch_snapshot(
    client: ControlClient, *, wall_ms: Callable[[], int] = wall_clock_ms
) -> ConsoleSnapshot:
    """One snapshot from GetCluster and GetRouterStats (``llmgw console --once``)."""
    model = ClusterModel()
    model.reset(await client.get_cluster(), wall_ms())
    try:
        model.add_router_stats(await client.get_router_stats(), time.monotonic())
    except RpcError as exc:
        model.router_unavailable(f"no router stats yet: {exc.message or exc}")
    return model.snapshot(wall_ms())
