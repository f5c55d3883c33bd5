"""One shard on its agent: its engine process, its state, and the operations on it.

A ``ShardRunner`` runs one operation at a time, in order: *run* (spawn, probe until READY,
watch, restart after a failure with backoff), *halt* (SIGTERM to the group, SIGKILL after
the grace, STOPPED), *drain* (DRAINING until the engine holds no request, then halt) and
*replace* (halt, then run a new command). A new operation interrupts the one in progress
when that one is interruptible (running, restarting, waiting for a drain), and supersedes
one still queued behind it: the latest command wins. A halt in progress is never
interrupted; the next operation waits for it. Cancelling a runner (the agent stopping)
leaves its engine running, to be adopted by the next agent.

What the server last asked of the shard (its ``mode`` and ``target``) is the runner's own:
the supervisor passes each command on (``request_run``, ``request_stop``, ``request_drain``)
and the runner decides what it changes and which operation it queues.

Every state change goes through the lifecycle table (``llmgw.agent.shards``) and is
emitted as a ``ShardStatus`` with its reason. When an engine that publishes KV events turns
READY, the runner reads its ``/metrics`` once more for its KV block count and hands it to
``RunnerContext.kv_blocks`` (the supervisor caps the engine's mirrors at it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import shlex
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.agent.enginelog import DEFAULT_LINES, EngineLog
from llmgw.agent.engines.base import LaunchSpec
from llmgw.agent.errors import EngineFailed, SocketFolderError, SpawnError
from llmgw.agent.ipcdir import private_dir
from llmgw.agent.logfiles import DEFAULT_MAX_BYTES
from llmgw.agent.marks import CLUSTER_ENV, MARK_ENV, EngineMarks
from llmgw.agent.probe import EngineProbe, ProbeTimeouts
from llmgw.agent.process import EngineProcess
from llmgw.agent.records import EngineRecord, RecordStore
from llmgw.agent.shards import RestartPolicy, check_transition
from llmgw.api.llmgw.v1 import ShardState, ShardStatus, StartShard

log = logging.getLogger(__name__)

StatusSink = Callable[[ShardStatus], None]
KvBlocksSink = Callable[[str, int], None]
"""Told ``(shard_id, blocks)``: the KV blocks a shard's engine caches, once it is READY."""


@dataclass(frozen=True, slots=True)
class SupervisorConfig:
    """How patient the supervisor is with engines; every duration in seconds."""

    state_dir: Path
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    startup_timeout_s: float = 900.0  # spawn (or adoption) to READY; real models load slowly
    stop_grace_s: float = 30.0  # SIGTERM → SIGKILL when stopping, replacing, after a drain
    kill_grace_s: float = 5.0  # SIGTERM → SIGKILL for the group of an engine that failed
    drain_grace_s: float = 300.0  # a DrainShard without grace_seconds
    poll_s: float = 0.5  # process liveness and log tail
    startup_probe_s: float = 1.0  # readiness probe until READY
    ready_probe_s: float = 5.0  # health probe of a READY engine
    probe_failures: int = 3  # failed health probes in a row that make a READY engine FAILED
    drain_poll_s: float = 0.5  # /metrics while draining
    # A draining engine keeps serving at least this long (within the grace), so a router
    # that saw it READY a moment ago (a gateway's table, a client's list) stops first.
    drain_settle_s: float = 2.0
    probe: ProbeTimeouts = field(default_factory=ProbeTimeouts)
    log_lines: int = DEFAULT_LINES
    log_max_bytes: int = DEFAULT_MAX_BYTES  # SHARD.log past it is rotated (llmgw.agent.logfiles)
    host: str = "127.0.0.1"
    # The node this agent runs as: every engine it spawns carries ``LLMGW_SHARD=NODE/SHARD``
    # and its cluster in its environment (``llmgw.agent.marks``), so an agent whose state dir
    # was lost finds them. "" marks nothing.
    node_id: str = ""
    # Spawn, restart or stop nothing until the server accepted this agent (Supervisor.licence):
    # a second agent of the node (a copied state dir) must not touch the holder's engines.
    wait_for_server: bool = False

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def records_dir(self) -> Path:
        return self.state_dir / "engines"


class Mode(enum.Enum):
    """What the control server last asked of a shard."""

    RUN = "run"  # keep the engine serving; restart it after a failure
    DRAIN = "drain"  # let in-flight requests finish, then stop; never restart
    STOP = "stop"  # stop; never restart


@dataclass(frozen=True, slots=True)
class Command:
    """The engine command a shard runs, and its fingerprint."""

    launch: LaunchSpec
    env: Mapping[str, str] = field(repr=False)  # added to the agent's env; holds secrets
    fingerprint: str


@dataclass(frozen=True, slots=True)
class RunnerContext:
    """What every runner of one supervisor shares."""

    config: SupervisorConfig
    probe: EngineProbe
    records: RecordStore
    emit: StatusSink
    licensed: asyncio.Event = field(default_factory=asyncio.Event)  # the server accepted us
    marks: EngineMarks = field(default_factory=lambda: EngineMarks(""))  # node and cluster
    kv_blocks: KvBlocksSink | None = None  # where an engine's KV block count goes


class ShardRunner:
    """One shard: state, engine process and the queue of operations on it."""

    def __init__(
        self, ctx: RunnerContext, message: StartShard, command: Command | None, *, restarts: int = 0
    ) -> None:
        self.ctx = ctx
        self.message = message
        self.command = command
        self.target = command  # the command this shard runs once its queued operations are done
        self.mode = Mode.RUN
        self.state = ShardState.UNSPECIFIED
        self.reason = ""
        self.exit_code: int | None = None
        self.restarts = restarts
        self.port_in_use = 0  # the port refused because another process holds it
        self.since_ms = 0
        self.process: EngineProcess | None = None
        config = ctx.config
        path = config.log_dir / f"{message.shard_id}.log"
        self.log = EngineLog(path, max_lines=config.log_lines, max_file_bytes=config.log_max_bytes)
        self._started = time.monotonic()
        self._record: EngineRecord | None = None
        self._interruptible = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._latest: asyncio.Task[None] | None = None

    @property
    def shard_id(self) -> str:
        return self.message.shard_id

    # --- status ----------------------------------------------------------------------------

    def status(self) -> ShardStatus:
        """The shard as it is now, as the wire reports it."""
        m = self.message
        listening = self.state in (ShardState.LOADING, ShardState.READY, ShardState.DRAINING)
        launch = self.command.launch if self.command is not None else None
        endpoint = ""
        if listening and launch is not None and launch.listens_http:
            endpoint = f"http://{self.ctx.config.host}:{launch.port}"
        return ShardStatus(
            shard_id=m.shard_id,
            replica_id=m.replica_id,
            rank=m.rank,
            state=self.state,
            reason=self.reason,
            exit_code=self.exit_code or 0,
            exited=self.exit_code is not None,
            endpoint=endpoint,
            profile_fingerprint=m.profile_fingerprint,
            gpu_uuids=list(m.gpu_uuids),
            pid=self.process.pid if self.process is not None else 0,
            since_unix_ms=self.since_ms,
            restarts=self.restarts,
            engine=m.profile.engine if m.profile is not None else "",
            gave_up=self.state is ShardState.FAILED and self.command is None,
            port_in_use=self.port_in_use if self.state is ShardState.FAILED else 0,
        )

    def begin(self, state: ShardState, reason: str) -> None:
        """The first state of this runner (PENDING, or LOADING for an adopted engine)."""
        self._enter(state, reason)

    def note(self, reason: str) -> None:
        """Report a new reason without a state change."""
        self.reason = reason
        self.ctx.emit(self.status())

    def fail_now(self, reason: str, *, port_in_use: int = 0) -> None:
        """FAILED without an engine (a profile that cannot be run, or ``port_in_use``, the
        port it needs, held by another process); no restart."""
        self.command = self.target = None
        self.port_in_use = port_in_use
        self._set(ShardState.FAILED, reason)

    def _set(self, state: ShardState, reason: str) -> None:
        check_transition(self.state, state)
        self._enter(state, reason)

    def _enter(self, state: ShardState, reason: str) -> None:
        self.state, self.reason = state, reason
        self.since_ms = time.time_ns() // 1_000_000
        log.info("shard %s → %s: %s", self.shard_id, state.name, reason)
        self.ctx.emit(self.status())

    def _advance(self, state: ShardState, reason: str) -> None:
        if self.state is not state:
            self._set(state, reason)

    # --- what the server asks ----------------------------------------------------------------

    def request_run(self, message: StartShard, command: Command) -> bool:
        """Run ``command`` from now on, replacing what runs (a drain or stop in progress is
        interrupted where it can be); False, and nothing changes, when it runs that already."""
        target = self.target
        if self.mode is Mode.RUN and target and target.fingerprint == command.fingerprint:
            return False
        self.mode, self.target = Mode.RUN, command
        self.schedule(lambda: self.replace(message, command), interrupt=True)
        return True

    def request_stop(self, grace_s: float, reason: str, *, then: Callable[[], None]) -> None:
        """Halt the engine (SIGKILL after ``grace_s``) and never restart it; ``then()`` once it
        ended if nothing was asked since. A shard already stopping changes nothing."""
        if self.mode is Mode.STOP:
            return
        self.mode = Mode.STOP
        self.schedule(self._ending(lambda: self.halt(grace_s, reason), then), interrupt=True)

    def request_drain(self, grace_s: float, *, then: Callable[[], None]) -> None:
        """Drain (see ``drain``) and never restart; ``then()`` as for ``request_stop``. Only a
        shard asked to run drains: one draining or stopping goes on as it was."""
        if self.mode is not Mode.RUN:
            return
        self.mode = Mode.DRAIN
        self.schedule(self._ending(lambda: self.drain(grace_s), then), interrupt=True)

    def _ending(
        self, op: Callable[[], Awaitable[None]], then: Callable[[], None]
    ) -> Callable[[], Awaitable[None]]:
        """``op``, then ``then()`` if the shard ended (STOPPED or FAILED) with nothing queued
        and nothing asked since."""

        async def op_then() -> None:
            await op()
            ended = self.state in (ShardState.STOPPED, ShardState.FAILED)
            if self.mode is not Mode.RUN and self.is_last_operation() and ended:
                then()

        return op_then

    # --- operations ------------------------------------------------------------------------

    def schedule(self, op: Callable[[], Awaitable[None]], *, interrupt: bool) -> asyncio.Task[None]:
        """Run ``op`` after the operation in progress (interrupting it when allowed)."""
        previous = self._latest
        task = asyncio.create_task(self._after(previous, op, interrupt), name=self.shard_id)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._latest = task
        return task

    async def _after(
        self,
        previous: asyncio.Task[None] | None,
        op: Callable[[], Awaitable[None]],
        interrupt: bool,
    ) -> None:
        if previous is not None:
            if interrupt and self._interruptible:
                previous.cancel()
            await asyncio.wait([previous])
        self._interruptible = False
        await op()

    def is_last_operation(self) -> bool:
        """Whether the running operation is the last one scheduled (called from inside it)."""
        return self._latest is asyncio.current_task()

    async def settle(self) -> None:
        """Wait until the operations scheduled so far are done (tests, shutdown)."""
        while self._latest is not None and not self._latest.done():
            await asyncio.wait([self._latest])

    async def close(self) -> None:
        """Stop working on this shard; its engine keeps running (to be adopted)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def run(self) -> None:
        """Keep the engine serving: spawn, probe, watch; after a failure, back off, restart."""
        self._interruptible = True
        policy = self.ctx.config.restart
        failures = 0
        while True:
            ready_at: float | None = None
            try:
                if self.process is None:
                    await self.ctx.licensed.wait()
                    self._spawn()
                await self._until_ready()
                ready_at = time.monotonic()
                await self._while_ready()
            except EngineFailed as failure:
                if ready_at is not None and time.monotonic() - ready_at >= policy.stable_s:
                    failures = 0
                failures += 1
                delay = policy.delay(failures)
                await self._failed(failure, delay)
                if ready_at is None and self._lost_port():
                    return
                await asyncio.sleep(delay)
                self.restarts += 1

    def _lost_port(self) -> bool:
        """After the engine failed before serving (and is gone): whether another process
        took its port meanwhile, as happens between the check at StartShard and an engine
        that binds late. Then the shard gives up (``port_in_use``): restarting would fail
        the same way, and the server places it on another port at once."""
        port = self.command.launch.port if self.command is not None else 0
        taken = port_taken(self.ctx.config.host, port)
        if not taken:
            return False
        self.ctx.records.delete(self.shard_id)
        self._record = None
        self.command = self.target = None
        self.port_in_use = port
        self.note(f"{taken}; the engine could not listen: not restarted")
        return True

    def adopt(self, process: EngineProcess, record: EngineRecord) -> None:
        """Take over a running engine of a previous agent: LOADING until its probe passes."""
        self.process, self._record = process, record
        self._started = time.monotonic()
        self.log.follow_tail()
        self.begin(ShardState.LOADING, f"adopted engine pid {process.pid} from a previous agent")

    def resume_stop(self, process: EngineProcess, *, then: Callable[[], None]) -> None:
        """Take over an engine a previous agent was stopping: DRAINING until it is halted
        (once the server accepted this agent), then ``then()`` as for ``request_stop``."""
        self.process, self.mode = process, Mode.STOP
        self.begin(
            ShardState.DRAINING,
            f"finishing the stop of engine pid {process.pid} a previous agent began",
        )

        async def halt_when_licensed() -> None:
            await self.ctx.licensed.wait()
            grace = self.ctx.config.stop_grace_s
            await self.halt(grace, "stopped (the stop a previous agent began)")

        self.schedule(self._ending(halt_when_licensed, then), interrupt=False)

    async def halt(self, grace_s: float, reason: str) -> None:
        """Stop the engine (SIGTERM, SIGKILL to the group after ``grace_s``): STOPPED."""
        self._interruptible = False
        self._mark_stopping()
        if self.state is ShardState.READY:
            self._set(ShardState.DRAINING, f"stopping ({reason}); SIGKILL after {grace_s:g} s")
        ended = None
        if self.process is not None:
            ended = await self.process.terminate(grace_s)
            self.log.refresh()
        self.process = None
        self.ctx.records.delete(self.shard_id)
        self._record = None
        self.exit_code = ended.code if ended is not None else None
        if self.state is not ShardState.STOPPED:
            self._set(ShardState.STOPPED, reason)

    async def drain(self, grace_s: float) -> None:
        """DRAINING until the engine holds no request (or ``grace_s`` runs out), then halt."""
        self._interruptible = True
        config = self.ctx.config
        if self.state is not ShardState.READY or self.process is None:
            await self.halt(config.stop_grace_s, "drained (it was not serving)")
            return
        self._mark_stopping()
        self._set(ShardState.DRAINING, f"waiting for in-flight requests (grace {grace_s:g} s)")
        try:
            await self._pause(min(grace_s, config.drain_settle_s))
            why = await self._wait_idle(grace_s)
        except EngineFailed as failure:
            self._ended_while_draining(failure)
            return
        await self.halt(config.stop_grace_s, why)

    async def replace(self, message: StartShard, command: Command) -> None:
        """Stop the engine running the old command, then run ``command``."""
        await self.halt(self.ctx.config.stop_grace_s, "replaced by a new command")
        self.message, self.command, self.exit_code = message, command, None
        self._set(ShardState.PENDING, "starting the new command")
        await self.run()

    # --- the steps -------------------------------------------------------------------------

    def _spawn(self) -> None:
        command = self._command()
        argv = command.launch.argv
        if command.launch.kv_events is not None:  # the engine binds them: folders must exist
            for path in command.launch.kv_events.socket_paths:
                try:
                    private_dir(path.parent)  # ours alone, or others feed us their blocks
                except (SocketFolderError, OSError) as exc:
                    raise EngineFailed(f"KV event sockets: {exc}") from exc
        fd = self.log.open_for_engine(
            f"shard {self.shard_id} (restart {self.restarts}): {shlex.join(_masked(argv))}"
        )
        try:
            inherited = {k: v for k, v in os.environ.items() if k not in (MARK_ENV, CLUSTER_ENV)}
            env = {**inherited, **command.env, **self.ctx.marks.of(self.shard_id)}
            process = EngineProcess.spawn(argv, env, fd)
        except SpawnError as exc:
            raise EngineFailed(str(exc)) from exc
        finally:
            os.close(fd)
        self.process, self.exit_code = process, None
        self._started = time.monotonic()
        self._save_record(process)
        self._set(ShardState.STARTING, f"spawned pid {process.pid}")

    async def _until_ready(self) -> None:
        launch = self._command().launch
        timeout = self.ctx.config.startup_timeout_s
        deadline = self._started + timeout
        last = "not probed yet"
        while True:
            self._check_alive()
            if not launch.listens_http:  # nothing to probe: the leader's readiness tells
                self._advance(ShardState.LOADING, "headless rank: no HTTP endpoint to probe")
                await self._pause(self.ctx.config.startup_probe_s)
                self._set(ShardState.READY, "headless rank: running (the leader serves)")
                return
            seen = await self.ctx.probe.readiness(launch)
            self._check_alive()
            last = seen.detail
            if seen.state is ShardState.READY:
                self._advance(ShardState.LOADING, f"port {launch.port} accepting")
                self._set(ShardState.READY, seen.detail)
                await self._tell_kv_blocks(launch)
                return
            if seen.state is ShardState.LOADING:
                self._advance(ShardState.LOADING, seen.detail)
            if time.monotonic() >= deadline:
                raise EngineFailed(f"not ready after {timeout:g} s (last probe: {last})")
            await self._pause(self.ctx.config.startup_probe_s)

    async def _tell_kv_blocks(self, launch: LaunchSpec) -> None:
        """The engine's KV block count (one ``/metrics`` read), for the cap on its mirrors."""
        sink = self.ctx.kv_blocks
        if sink is None or launch.kv_events is None:
            return
        seen = await self.ctx.probe.kv_blocks(launch)
        if seen.count is None:
            log.info("shard %s: KV block count unknown (%s): its mirrors keep the fixed bound",
                     self.shard_id, seen.detail)  # fmt: skip
            return
        sink(self.shard_id, seen.count)

    async def _while_ready(self) -> None:
        config = self.ctx.config
        launch = self._command().launch
        failures = 0
        while True:
            await self._pause(config.ready_probe_s)
            if not launch.listens_http:
                continue
            error = await self.ctx.probe.health(launch)
            self._check_alive()
            if error is None:
                failures = 0
                continue
            failures += 1
            log.warning("shard %s: health probe failed (%d): %s", self.shard_id, failures, error)
            if failures >= config.probe_failures:
                raise EngineFailed(f"health probe failed {failures} times in a row: {error}")

    async def _wait_idle(self, grace_s: float) -> str:
        """Why the drain ends: nothing in flight, no way to tell, or the grace ran out."""
        launch = self._command().launch
        if not launch.listens_http:
            return "drained (headless rank: nothing to wait for)"
        deadline = time.monotonic() + grace_s
        while True:
            seen = await self.ctx.probe.in_flight(launch)
            self._check_alive()
            if seen.count == 0:
                return "drained: no request in flight"
            if not seen.supported:
                return f"drained without waiting: {seen.detail}"
            if time.monotonic() >= deadline:
                return f"drain grace of {grace_s:g} s ran out ({seen.detail})"
            await self._pause(self.ctx.config.drain_poll_s)

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, following the log and noticing an exit within ``poll_s``."""
        end = time.monotonic() + seconds
        while True:
            self.log.refresh()
            self._check_alive()
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, self.ctx.config.poll_s))

    def _check_alive(self) -> None:
        if self.process is None:
            return
        ended = self.process.poll()
        if ended is None:
            return
        self.log.refresh()
        last = self.log.last_line()
        detail = f"pid {self.process.pid} {ended.describe()}"
        raise EngineFailed(
            f"{detail}; last output: {last}" if last else detail, exit_code=ended.code
        )

    async def _failed(self, failure: EngineFailed, delay: float) -> None:
        self.exit_code = failure.exit_code
        reason = f"{failure.reason}; restart {self.restarts + 1} in {delay:g} s"
        if self.state is ShardState.FAILED:
            self.note(reason)
        else:
            self._set(ShardState.FAILED, reason)
        if self.process is not None:
            await self.process.terminate(self.ctx.config.kill_grace_s)
            self.process = None

    def _ended_while_draining(self, failure: EngineFailed) -> None:
        self.process = None
        self.ctx.records.delete(self.shard_id)
        self._record = None
        self.exit_code = failure.exit_code
        if failure.exit_code == 0:
            self._set(ShardState.STOPPED, f"ended while draining: {failure.reason}")
        else:
            self._set(ShardState.FAILED, f"ended while draining: {failure.reason}")

    def _save_record(self, process: EngineProcess) -> None:
        command = self._command()
        record = EngineRecord(
            shard_id=self.shard_id,
            identity=process.identity,
            fingerprint=command.fingerprint,
            port=command.launch.port,
            engine=command.launch.engine,
            start=self.message,
            restarts=self.restarts,
            started_unix_ms=time.time_ns() // 1_000_000,
            log_path=str(self.log.path),
        )
        self._write(record)

    def _mark_stopping(self) -> None:
        """A stop began: an agent restarted meanwhile finishes it instead of restarting."""
        if self._record is not None and self.process is not None and not self._record.stopping:
            self._write(dataclasses.replace(self._record, stopping=True))

    def _write(self, record: EngineRecord) -> None:
        self._record = record
        try:
            self.ctx.records.save(record)
        except OSError as exc:
            log.error("shard %s: cannot write its record (no adoption after a restart): %s",
                      self.shard_id, exc)  # fmt: skip

    def _command(self) -> Command:
        if self.command is None:
            raise EngineFailed("no command to run (the profile was refused)")
        return self.command


def _masked(argv: tuple[str, ...]) -> list[str]:
    """``argv`` with the value of ``--api-key`` hidden, for the log."""
    return ["***" if i and argv[i - 1] == "--api-key" else word for i, word in enumerate(argv)]


def port_taken(host: str, port: int) -> str:
    """Why the engine could not listen on ``port`` (another process holds it), or "".

    Checked before a new shard starts, and after its engine failed before it served: its
    engine would only fail and be restarted until the server gives up on it; refused
    (``gave_up`` with ``port_in_use``), the server places it again at once on another
    port."""
    if not port:
        return ""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as engines bind
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"port {port} on {host} is in use by another process ({exc.strerror})"
    return ""
