"""The engine supervisor: the shards this agent runs, and the commands that change them.

::

    async with Supervisor(config, launcher=build, on_status=link.send_status) as supervisor:
        await supervisor.handle(control_message)   # StartShard / StopShard / DrainShard
        register.shards = supervisor.statuses()

Commands return at once: the supervisor finds the shard by id and passes the command on
to its ``ShardRunner``, which owns what was asked of it and queues the work (spawning,
probing, stopping with grace) in its own task (see ``llmgw.agent.runner``); every state
change is emitted as a ``ShardStatus``. A command that cannot be carried out (a profile the
adapter refuses, an invalid shard id) is reported as FAILED with the reason; nothing is
raised to the stream.
Every profile is checked with ``llmgw.engineinput`` (environment names, flags, paths)
before any command is built, whichever launcher builds it: the control server checked it
too, and an engine with an environment or flags the check refuses is never started.

``StartShard`` for a shard that already runs the same command (same fingerprint: argv and
added environment) changes nothing; with another command the old engine is stopped and
the new one started. Opening the supervisor adopts the engines a previous agent left
running (``llmgw.agent.records``); closing it leaves every engine running.

With ``wait_for_server`` the supervisor only watches until :meth:`Supervisor.licence` (the
server accepted this agent's registration): no engine is spawned, restarted or stopped
before, so a second agent of a node (a copied state dir, refused by the server) never
touches the holder's engines. At the licence it looks for engines marked as this node's
(``llmgw.agent.marks``) that no record names (its state dir was lost) and stops them
cleanly (SIGTERM to the group, SIGKILL after ``stop_grace_s``) before it carries out any
StartShard: the server starts them again where it wants them, instead of finding their
ports held by engines nobody supervises.

With a `KvEventHub`, the supervisor follows the KV events of every shard whose command
publishes them (``LaunchSpec.kv_events``) while the shard is LOADING, READY or DRAINING
(an adopted engine starts LOADING), and forgets them in any other state: a stopped, failed
or restarting engine's blocks leave the mirror, and upstream, at once. The KV block count
each engine tells when it turns READY caps its mirrors (`KvEventHub.cap`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self

from llmgw.addresses import free_port
from llmgw.agent.engines.base import EngineError, LaunchSpec, ShardSpec, check_profile
from llmgw.agent.kvhub import KvEventHub
from llmgw.agent.marks import EngineMarks
from llmgw.agent.probe import EngineProbe
from llmgw.agent.process import EngineProcess, is_running, kill_leftovers
from llmgw.agent.records import SHARD_ID, EngineRecord, RecordStore
from llmgw.agent.runner import (
    Command,
    RunnerContext,
    ShardRunner,
    StatusSink,
    SupervisorConfig,
    port_taken,
)
from llmgw.agent.shards import NEW_STATE, engine_env, launch_fingerprint
from llmgw.api.llmgw.v1 import ControlMessage, ShardState, ShardStatus, StartShard

__all__ = ["Launcher", "Supervisor", "SupervisorConfig"]

log = logging.getLogger(__name__)

Launcher = Callable[[ShardSpec], LaunchSpec]
"""Builds an engine's command line (``llmgw.agent.engines.build_launch`` with its options)."""

_KV_FOLLOWED = frozenset({ShardState.LOADING, ShardState.READY, ShardState.DRAINING})
"""Shard states whose engine's KV events are followed (its sockets are bound)."""


class Supervisor:
    """Every shard of this agent, by shard id."""

    def __init__(
        self,
        config: SupervisorConfig,
        *,
        launcher: Launcher,
        on_status: StatusSink | None = None,
        kv: KvEventHub | None = None,
    ) -> None:
        self.config = config
        self._launcher = launcher
        self._on_status = on_status
        self._kv = kv
        self._records = RecordStore(config.records_dir)
        self._shards: dict[str, ShardRunner] = {}
        self._ctx: RunnerContext | None = None
        self._sweep: asyncio.Task[None] | None = None  # stops unknown marked engines

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Start working: adopt the engines a previous agent left (or start them again)."""
        probe = EngineProbe(self.config.probe, host=self.config.host)
        kv_blocks = self._kv.cap if self._kv is not None else None
        self._ctx = RunnerContext(
            self.config,
            probe,
            self._records,
            self._emit,
            kv_blocks=kv_blocks,
            marks=EngineMarks(self.config.node_id),
        )
        if not self.config.wait_for_server:
            self._ctx.licensed.set()
        records, errors = self._records.load_all()
        for path, error in errors:
            log.warning("%s; removing it", error)
            self._records.discard(path)
        for record in records:
            self._restore(record)

    async def close(self) -> None:
        """Stop supervising; the engines keep running, to be adopted by the next agent."""
        if self._sweep is not None:
            self._sweep.cancel()
            await asyncio.gather(self._sweep, return_exceptions=True)
        runners, self._shards = list(self._shards.values()), {}
        await asyncio.gather(*(runner.close() for runner in runners))
        if self._ctx is not None:
            await self._ctx.probe.aclose()
            self._ctx = None

    # --- what the link asks ----------------------------------------------------------------

    def statuses(self) -> list[ShardStatus]:
        """Every shard this agent runs, for ``Register``."""
        return [runner.status() for _, runner in sorted(self._shards.items())]

    def status(self, shard_id: str) -> ShardStatus | None:
        runner = self._shards.get(shard_id)
        return runner.status() if runner is not None else None

    def logs(self, shard_id: str, lines: int | None = None) -> list[str]:
        """The last lines the shard's engine wrote (empty for an unknown shard)."""
        runner = self._shards.get(shard_id)
        return runner.log.tail(lines) if runner is not None else []

    async def settle(self, shard_id: str) -> None:
        """Wait until the operations scheduled on a shard so far are done."""
        runner = self._shards.get(shard_id)
        if runner is not None:
            await runner.settle()

    async def handle(self, message: ControlMessage) -> None:
        """Carry out one command from the control server; never raises but cancellation."""
        try:
            if message.start_shard is not None:
                await self.start(message.start_shard)
            elif message.stop_shard is not None:
                stop = message.stop_shard
                await self.stop(
                    stop.shard_id, grace_s=stop.grace_seconds or None, reason=stop.reason
                )
            elif message.drain_shard is not None:
                drain = message.drain_shard
                await self.drain(drain.shard_id, grace_s=drain.grace_seconds or None)
            else:
                log.warning("control message without a command ignored")
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug of ours: log it (never the message: it holds API keys)
            log.exception("command %s failed", _describe(message))

    # --- commands --------------------------------------------------------------------------

    def licence(self, cluster_id: str = "") -> None:
        """The server of ``cluster_id`` accepted this agent: act on engines from now on, and
        mark the engines it spawns as that cluster's (idempotent; an agent running no engines
        may join another cluster on a later acceptance: ``llmgw.agent.cluster``)."""
        ctx = self._context()
        ctx.marks.joined(cluster_id)
        if ctx.licensed.is_set():
            return
        ctx.licensed.set()
        self._sweep = asyncio.create_task(self._stop_unknown_engines(), name="unknown-engines")

    async def _stop_unknown_engines(self) -> None:
        """Stop the engines marked as this node's that no runner knows (see the module doc)."""
        known = {r.process.pid for r in self._shards.values() if r.process is not None}
        unknown = [e for e in self._context().marks.find() if e.identity.pid not in known]
        for engine in unknown:
            log.warning(
                "shard %s: engine pid %d is marked as this node's but no record names it (was "
                "the state dir lost?); stopping it so the server can start it again",
                engine.shard_id,
                engine.identity.pid,
            )
        await asyncio.gather(
            *(EngineProcess(e.identity).terminate(self.config.stop_grace_s) for e in unknown)
        )

    async def start(self, message: StartShard) -> None:
        """Run the shard ``message`` describes (idempotent; a new command replaces the old)."""
        ctx = self._context()
        if self._sweep is not None and not self._sweep.done():
            await asyncio.shield(self._sweep)  # its ports are free before anything starts
        if not SHARD_ID.match(message.shard_id):
            self._emit(_refused(message, "invalid shard id (letters, digits, '.', '_', '-')"))
            return
        existing = self._shards.get(message.shard_id)
        try:
            command = self._command(message, existing.target if existing else None)
        except EngineError as exc:
            self._refuse(ctx, message, existing, str(exc))
            return
        if existing is None and (taken := port_taken(ctx.config.host, command.launch.port)):
            log.warning("shard %s: StartShard refused: %s", message.shard_id, taken)
            runner = self._add(ShardRunner(ctx, message, None))
            runner.begin(NEW_STATE, "accepted")
            runner.fail_now(taken, port_in_use=command.launch.port)
            return
        if existing is None:
            runner = self._add(ShardRunner(ctx, message, command))
            runner.begin(NEW_STATE, "accepted")
            runner.schedule(runner.run, interrupt=False)
            return
        if not existing.request_run(message, command):
            log.info("shard %s already runs this command; StartShard changes nothing",
                     message.shard_id)  # fmt: skip

    async def stop(self, shard_id: str, *, grace_s: float | None = None, reason: str = "") -> None:
        """Stop a shard: SIGTERM, SIGKILL after the grace, STOPPED; never restarted."""
        runner = self._shards.get(shard_id)
        if runner is None:
            self._emit(_unknown(shard_id))
            return
        grace = self.config.stop_grace_s if grace_s is None else grace_s
        why = f"stopped: {reason}" if reason else "stopped"
        runner.request_stop(grace, why, then=functools.partial(self._forget, runner))

    async def drain(self, shard_id: str, *, grace_s: float | None = None) -> None:
        """DRAINING until no request is in flight (or the grace runs out), then STOPPED."""
        runner = self._shards.get(shard_id)
        if runner is None:
            self._emit(_unknown(shard_id))
            return
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        runner.request_drain(grace, then=functools.partial(self._forget, runner))

    # --- adoption --------------------------------------------------------------------------

    def _restore(self, record: EngineRecord) -> None:
        """Adopt the engine of ``record``, replace it, or start it again if it is gone."""
        if record.stopping:
            self._finish_stop(record)
            return
        ctx = self._context()
        pid = record.identity.pid
        try:
            command: Command | None = self._command(record.start, None, port=record.port)
            refused = ""
        except EngineError as exc:
            command, refused = None, str(exc)
        runner = self._add(ShardRunner(ctx, record.start, command, restarts=record.restarts))
        alive = is_running(record.identity)
        if alive and command is not None and command.fingerprint == record.fingerprint:
            log.info("shard %s: adopting engine pid %d", record.shard_id, pid)
            runner.adopt(EngineProcess(record.identity), record)
            runner.schedule(runner.run, interrupt=False)
            return
        if alive:
            why = f"cannot rebuild its command: {refused}" if refused else "its command changed"
            runner.begin(NEW_STATE, f"stopping engine pid {pid} of a previous agent: {why}")
            old = EngineProcess(record.identity)
            runner.schedule(
                self._licensed(lambda: self._relaunch(runner, old, refused)), interrupt=False
            )
            return
        kill_leftovers(record.identity)
        self._records.delete(record.shard_id)
        runner.begin(NEW_STATE, f"engine pid {pid} of a previous agent is gone; starting again")
        if refused:
            runner.fail_now(refused)
        else:
            runner.schedule(runner.run, interrupt=False)

    def _finish_stop(self, record: EngineRecord) -> None:
        """The previous agent died while stopping this engine: stop it, never restart it."""
        pid = record.identity.pid
        if not is_running(record.identity):
            kill_leftovers(record.identity)
            self._records.delete(record.shard_id)
            why = f"stopped: engine pid {pid} ended while a previous agent stopped it"
            self._emit(_status_of(record.start, ShardState.STOPPED, why))
            return
        runner = self._add(
            ShardRunner(self._context(), record.start, None, restarts=record.restarts)
        )
        runner.resume_stop(
            EngineProcess(record.identity), then=functools.partial(self._forget, runner)
        )

    def _licensed(self, op: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """``op`` once the server accepted this agent (it stops an engine)."""

        async def when_licensed() -> None:
            await self._context().licensed.wait()
            await op()

        return when_licensed

    async def _relaunch(self, runner: ShardRunner, old: EngineProcess, refused: str) -> None:
        await old.terminate(self.config.stop_grace_s)
        self._records.delete(runner.shard_id)
        if refused:
            runner.fail_now(refused)
        else:
            await runner.run()

    # --- helpers ---------------------------------------------------------------------------

    def _command(self, message: StartShard, current: Command | None, *, port: int = 0) -> Command:
        """The command for ``message``; a port of 0 keeps the shard's port or picks a free one."""
        spec = ShardSpec.from_start(message)
        if spec.port == 0:
            chosen = port or (current.launch.port if current is not None else 0) or free_port()
            spec = dataclasses.replace(spec, port=chosen)
        check_profile(spec)  # whatever builds the command: the server checked, we check again
        try:
            launch = self._launcher(spec)
        except EngineError:
            raise
        except Exception as exc:  # an adapter's bug must not take the agent down
            log.exception("building the command of shard %s failed", message.shard_id)
            raise EngineError(f"internal error building the command: {exc!r}") from exc
        env = engine_env(spec, launch)
        return Command(launch, env, launch_fingerprint(launch.argv, env))

    def _refuse(
        self, ctx: RunnerContext, message: StartShard, existing: ShardRunner | None, reason: str
    ) -> None:
        log.warning("shard %s: StartShard refused: %s", message.shard_id, reason)
        if existing is not None:
            existing.note(f"StartShard refused: {reason}; the shard is unchanged")
            return
        runner = self._add(ShardRunner(ctx, message, None))
        runner.begin(NEW_STATE, "accepted")
        runner.fail_now(reason)

    def _add(self, runner: ShardRunner) -> ShardRunner:
        self._shards[runner.shard_id] = runner
        return runner

    def _forget(self, runner: ShardRunner) -> None:
        """Drop a shard that ended (stopped or failed) unless a new runner took its id."""
        if self._shards.get(runner.shard_id) is runner:
            del self._shards[runner.shard_id]

    def _context(self) -> RunnerContext:
        if self._ctx is None:
            raise RuntimeError("the supervisor is not open (use 'async with Supervisor(...)')")
        return self._ctx

    def _emit(self, status: ShardStatus) -> None:
        if self._kv is not None:
            self._follow_kv(self._kv, status)
        if self._on_status is not None:
            self._on_status(status)

    def _follow_kv(self, kv: KvEventHub, status: ShardStatus) -> None:
        """Follow the shard's KV events while its engine runs; forget them otherwise."""
        runner = self._shards.get(status.shard_id)
        command = runner.command if runner is not None else None
        endpoints = command.launch.kv_events if command is not None else None
        if endpoints is not None and status.state in _KV_FOLLOWED:
            kv.follow(status.shard_id, endpoints)
        else:
            kv.forget(status.shard_id)


def _describe(message: ControlMessage) -> str:
    """The command and its shard, for logs (StartShard carries an API key)."""
    for command in (message.start_shard, message.stop_shard, message.drain_shard):
        if command is not None:
            return f"{type(command).__name__} {command.shard_id!r}"
    return "(none)"


def _status_of(message: StartShard, state: ShardState, reason: str) -> ShardStatus:
    """A status for a shard that has no runner (nothing runs, nothing will)."""
    return ShardStatus(
        shard_id=message.shard_id,
        replica_id=message.replica_id,
        rank=message.rank,
        state=state,
        reason=reason,
        profile_fingerprint=message.profile_fingerprint,
        since_unix_ms=time.time_ns() // 1_000_000,
    )


def _refused(message: StartShard, reason: str) -> ShardStatus:
    status = _status_of(message, ShardState.FAILED, f"StartShard refused: {reason}")
    status.gave_up = True
    return status


def _unknown(shard_id: str) -> ShardStatus:
    return _status_of(StartShard(shard_id=shard_id), ShardState.STOPPED, "not running on this node")
