"""Attacks on the KV event channel between an engine and its agent, from other processes.

* Another local user (``nobody``) squats on the folder where an agent with a long state dir
  used to put its engines' sockets (``/tmp/llmgw-kv-`` and a hash anyone can compute) and
  binds sockets there before the engine starts: the agent must never follow them.
* A publisher (a second process) sends a 300 MB message and floods a mirror with more
  blocks than any engine caches: the follower's memory stays bounded, the mirror resets
  (a decode error), and the follow keeps working.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_kvevents import (
    TOPIC,
    Engine,
    FakeControl,
    Index,
    _caught_up,
    _kill_engines,
    _prompt,
    _start_sim_shard,
    control,
    engine,
    sock_dir,
    until,
)

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.daemon import Agent, AgentConfig
from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.shards import RestartPolicy
from llmgw.api.llmgw.v1 import ControlMessage, ShardState, StopShard
from llmgw.kvcache import block_hashes, encode_frames, event_hash

__all__ = ["control", "engine", "sock_dir"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(120)
HERE = Path(__file__).parent
ATTACKER_HASHES = [0xBAD0_0000 + i for i in range(4)]


def _old_short_folder(state_dir: Path, shard_id: str) -> Path:
    """Where agents put a long state dir's sockets before: anyone can compute it."""
    key = os.fsencode(state_dir.absolute()) + b"\0" + shard_id.encode()
    return Path("/tmp") / f"llmgw-kv-{hashlib.sha256(key).hexdigest()[:24]}"


@pytest.fixture
async def squatter(tmp_path: Path) -> AsyncIterator[tuple[Path, asyncio.subprocess.Process]]:
    """``nobody`` squatting, for 25 s, on the old folder of shard kv1 of a long state dir."""
    state = tmp_path / ("s" * (120 - len(str(tmp_path))))
    folder = _old_short_folder(state, "kv1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "kv_squatter.py"),
        str(folder), "25", *map(str, ATTACKER_HASHES),
        stdout=asyncio.subprocess.PIPE, cwd="/",
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            assert (await proc.stdout.readline()).strip() == b"ready"
        yield state, proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="the squatter becomes nobody: needs root")
async def test_a_squatted_socket_folder_never_feeds_the_agent(
    control: tuple[FakeControl, int],
    squatter: tuple[Path, asyncio.subprocess.Process],
) -> None:
    fake, port = control
    state, proc = squatter
    config = AgentConfig(
        "127.0.0.1",
        port,
        state,
        simulate="cpu-only",
        backoff=BackoffPolicy(base_s=0.05, cap_s=0.2),
        drain_settle_s=0.0,
        restart=RestartPolicy(base_s=0.2, cap_s=1.0),
        kv_events=KvFollowConfig(flush_interval_s=0.01, replay_timeout_s=0.5),
    )
    agent = Agent(config)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    index = Index()
    try:
        await until(lambda: fake.sessions)
        await fake.commands.put(ControlMessage(start_shard=_start_sim_shard()))
        await until(lambda: fake.state("kv1") is ShardState.READY, 30)
        tokens = await _prompt(fake.statuses("kv1")[-1].endpoint)
        digests = block_hashes(tokens, 16, algo="sha256_cbor", seed="0", vllm_version="0.32.0")
        engine = {event_hash(d) for d in digests}

        def seen() -> set[int]:
            return set(_caught_up(index, fake.kv(0)).of("kv1"))

        await until(lambda: engine <= seen() or set(ATTACKER_HASHES) & seen(), 20)
        assert not set(ATTACKER_HASHES) & seen(), "the agent mirrors the squatter's blocks"
        assert engine <= seen()  # it follows the real engine
        await asyncio.sleep(1.0)  # and goes on doing so
        assert not set(ATTACKER_HASHES) & seen()
        kv = agent.kv.counters()["kv1"]
        assert kv.decode_errors == 0

        await fake.commands.put(
            ControlMessage(stop_shard=StopShard(shard_id="kv1", grace_seconds=5))
        )
        await until(lambda: fake.state("kv1") is ShardState.STOPPED, 15)
    finally:
        stop.set()
        await running
        _kill_engines(fake.statuses("kv1"))
    proc.kill()
    assert proc.stdout is not None
    heard = (await proc.stdout.read()).decode()
    assert "subscribed" not in heard and "replay" not in heard, heard
    _check_private_short_folder(state)


def _check_private_short_folder(state: Path) -> None:
    """The engine's sockets lived elsewhere, in a folder of the agent's user alone."""
    short = Path((state / "kv-ipc-dir").read_text().strip())
    try:
        assert short != _old_short_folder(state, "kv1")
        assert short.stat().st_uid == os.geteuid() and short.stat().st_mode & 0o077 == 0
    finally:
        shutil.rmtree(short, ignore_errors=True)


class Follower:
    """`kv_follower.py` in its own process: its latest counters and memory."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.last: dict[str, int] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.last = json.loads(line)

    def __getitem__(self, name: str) -> int:
        return self.last.get(name) or 0

    async def aclose(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        async with asyncio.timeout(10):
            await self.proc.wait()
        await self._reader


@pytest.fixture
async def follower(sock_dir: Path) -> AsyncIterator[Follower]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HERE / "kv_follower.py"), str(sock_dir), str(MAX_BLOCKS),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    follower = Follower(proc)
    try:
        yield follower
    finally:
        await follower.aclose()


async def _applied(engine: Engine, follower: Follower) -> None:
    """Publish a block every 0.1 s until the follower applied the last batch (it may be
    reconnecting: a PUB drops what it sends before the SUB is back)."""
    try:
        async with asyncio.timeout(20):
            engine.pub.publish([engine.store(1)])
            await asyncio.sleep(0.1)
            while follower["last_seq"] != engine.pub.last_seq:
                engine.pub.publish([engine.store(1)])
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(
            f"at seq {engine.pub.last_seq}, the follower: {follower.last}"
        ) from None


MAX_BLOCKS = 5000
BIG = 300 * 2**20


async def test_a_huge_message_and_a_block_flood_cost_the_follower_nothing_for_good(
    engine: Engine, follower: Follower
) -> None:
    for _ in range(500):  # until the SUB has joined
        engine.pub.publish([engine.store(1)])
        await asyncio.sleep(0.02)
        if follower["batches"]:
            break
    await until(lambda: follower["last_seq"] == engine.pub.last_seq)
    peak = follower["VmHWM"]

    # 300 MB in one message part, as the next batch
    big = engine.pub._pub
    assert big is not None
    await asyncio.to_thread(big.send_multipart, encode_frames(TOPIC, engine.pub._seq, bytes(BIG)),
                            copy=False)  # fmt: skip
    await _applied(engine, follower)
    grown_mib = (follower["VmHWM"] - peak) / 1024
    assert grown_mib < 64, f"the follower grew by {grown_mib:.0f} MiB for one message"
    assert follower["restarts"] == 1  # ZMQ dropped the connection; the follower dialled again

    # more blocks than any engine caches: a decode error that resets the mirror
    errors, resets = follower["decode_errors"], follower["resets"]
    for _ in range(2 * MAX_BLOCKS // 500):
        engine.pub.publish([engine.store(500)])
    await _applied(engine, follower)
    assert follower["decode_errors"] > errors and follower["resets"] > resets
    assert follower["blocks"] <= MAX_BLOCKS

    # and the follow goes on
    engine.blocks.clear()
    await _applied(engine, follower)
    assert 0 < follower["blocks"] <= MAX_BLOCKS
