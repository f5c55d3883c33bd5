"""AgentLink with several control servers (issue #17): following a follower's redirect to
the leader, moving on from one that is down, and fencing a deposed leader's epoch."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from fake_control import FakeControl, serving

from llmgw.addresses import free_port
from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.epoch import LEADER_EPOCH_FILE, EpochFileError, LeaderEpoch
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.api.llmgw.v1 import ControlMessage, NodeInfo, StopShard

SLOW = BackoffPolicy(base_s=30.0, cap_s=30.0)  # a backoff would outlast every test's wait
pytestmark = pytest.mark.timeout(30)


def stop(shard_id: str, epoch: int) -> ControlMessage:
    return ControlMessage(stop_shard=StopShard(shard_id=shard_id), leader_epoch=epoch)


@contextlib.asynccontextmanager
async def linked(
    ports: list[int], seen: list[ControlMessage], epoch: LeaderEpoch | None
) -> AsyncIterator[AgentLink]:
    async def on_command(message: ControlMessage) -> None:
        seen.append(message)

    first, *more = ports
    config = LinkConfig(
        "127.0.0.1", first, more_servers=tuple(("127.0.0.1", p) for p in more), backoff=SLOW
    )
    link = AgentLink(
        config,
        node=lambda: NodeInfo(node_id="n1"),
        telemetry=list,
        on_command=on_command,
        epoch=epoch,
    )
    task = asyncio.create_task(link.run())
    try:
        yield link
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(predicate: Callable[[], object], limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not predicate():  # noqa: ASYNC110 (polls plain attributes)
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("linger", [True, False], ids=["not_leader", "unavailable-only"])
async def test_a_follower_redirects_the_agent_to_the_leader_at_once(
    tmp_path: Path, linger: bool
) -> None:
    leader = FakeControl(epoch=3, commands=[stop("s1", 3)])
    async with serving(leader) as leader_port:
        follower = FakeControl(
            follower=True,
            leader_address=f"127.0.0.1:{leader_port}",
            leader_epoch=3,
            linger=linger,
        )
        async with serving(follower) as follower_port:
            seen: list[ControlMessage] = []
            epoch = LeaderEpoch(tmp_path)
            async with linked([follower_port, leader_port], seen, epoch) as link:
                await until(lambda: seen)
                assert link.stats.redirects == 1
                assert link.stats.server == f"127.0.0.1:{leader_port}"
                assert link.backoff.failures == 0  # no backoff: SLOW would have taken 15 s
            assert follower.connects == 1 and leader.registers == 1
            assert seen[0].stop_shard is not None and seen[0].stop_shard.shard_id == "s1"
    assert LeaderEpoch(tmp_path).remembered == 3  # a restarted agent keeps the epoch


async def test_a_down_server_and_a_leader_not_in_the_list_lead_to_the_next_server(
    tmp_path: Path,
) -> None:
    leader = FakeControl(epoch=1, commands=[stop("s1", 1)])
    stranger = FakeControl(follower=True, leader_address="10.9.9.9:50051", leader_epoch=1)
    async with serving(leader) as leader_port, serving(stranger) as stranger_port:
        seen: list[ControlMessage] = []
        async with linked([free_port(), stranger_port, leader_port], seen, None) as link:
            await until(lambda: seen)
            assert link.stats.redirects == 0
            assert link.stats.server == f"127.0.0.1:{leader_port}"
        assert stranger.connects == 1


async def test_a_deposed_leader_is_fenced_and_the_agent_moves_on(tmp_path: Path) -> None:
    (tmp_path / LEADER_EPOCH_FILE).write_text("5\n")
    deposed = FakeControl(epoch=4, commands=[stop("old", 4)])
    leader = FakeControl(epoch=6, commands=[stop("new", 6)])
    async with serving(deposed) as deposed_port, serving(leader) as leader_port:
        seen: list[ControlMessage] = []
        epoch = LeaderEpoch(tmp_path)
        async with linked([deposed_port, leader_port], seen, epoch) as link:
            await until(lambda: seen)
            assert link.stats.fenced == 1
        assert [m.stop_shard.shard_id for m in seen if m.stop_shard] == ["new"]
        assert deposed.registers == 1 and epoch.refused == 1
    assert (tmp_path / LEADER_EPOCH_FILE).read_text() == "6\n"


async def test_a_command_of_an_older_epoch_is_never_carried_out(tmp_path: Path) -> None:
    (tmp_path / LEADER_EPOCH_FILE).write_text("5\n")
    # Registered at epoch 5, then a command of epoch 4, then one of epoch 0 (pre-#17)
    server = FakeControl(epoch=5, commands=[stop("old", 4), stop("zero", 0)])
    async with serving(server) as port:
        seen: list[ControlMessage] = []
        epoch = LeaderEpoch(tmp_path)
        async with linked([port], seen, epoch) as link:
            await until(lambda: link.stats.fenced >= 1)
        assert seen == []
    assert LeaderEpoch(tmp_path).remembered == 5  # never lowered


def test_the_epoch_file_is_owner_only_and_kept_across_restarts(tmp_path: Path) -> None:
    epoch = LeaderEpoch(tmp_path)
    assert epoch.remembered == 0 and epoch.admit(0, what="x", server="s")
    assert epoch.admit(9, what="x", server="s")
    mode = stat.S_IMODE((tmp_path / LEADER_EPOCH_FILE).stat().st_mode)
    assert mode == 0o600
    again = LeaderEpoch(tmp_path)
    assert again.remembered == 9
    assert not again.admit(0, what="x", server="s")  # epoch 0 only while none is remembered
    assert not again.admit(8, what="x", server="s") and again.refused == 2
    assert again.admit(9, what="x", server="s")


def test_epochs_compare_within_one_cluster(tmp_path: Path) -> None:
    epoch = LeaderEpoch(tmp_path)
    assert epoch.admit(7, what="x", server="s", cluster="aaaa")
    assert (tmp_path / LEADER_EPOCH_FILE).read_text() == "7 aaaa\n"
    assert not epoch.admit(6, what="x", server="s", cluster="aaaa")  # a deposed leader of it
    # a new database (another cluster id) starts at epoch 1: not fenced by the old one's
    assert epoch.admit(1, what="x", server="s", cluster="bbbb")
    again = LeaderEpoch(tmp_path)
    assert (again.remembered, again.cluster) == (1, "bbbb")
    assert not again.admit(0, what="x", server="s", cluster="bbbb")


@pytest.mark.parametrize("text", ["", "abc\n", "-3\n", "1" * 21, "3 not/an id\n"])
def test_a_foreign_epoch_file_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / LEADER_EPOCH_FILE
    path.write_text(text)
    with pytest.raises(EpochFileError, match=LEADER_EPOCH_FILE):
        LeaderEpoch(tmp_path)


async def test_a_leader_named_with_an_older_epoch_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / LEADER_EPOCH_FILE).write_text("3\n")
    leader = FakeControl(epoch=3, commands=[stop("s1", 3)])
    async with serving(leader) as leader_port:
        stale = FakeControl(
            follower=True, leader_address=f"127.0.0.1:{leader_port}", leader_epoch=2, linger=True
        )
        async with serving(stale) as stale_port:
            seen: list[ControlMessage] = []
            async with linked([stale_port, leader_port], seen, LeaderEpoch(tmp_path)) as link:
                await until(lambda: seen)
                assert link.stats.redirects == 0  # reached as the next server, not followed


async def test_the_agent_wires_the_server_list_and_its_epoch_file(tmp_path: Path) -> None:
    from llmgw.agent.daemon import Agent, AgentConfig, AgentConfigError

    state = tmp_path / "state"
    leader = FakeControl(epoch=4)
    async with serving(leader) as leader_port:
        follower = FakeControl(
            follower=True, leader_address=f"127.0.0.1:{leader_port}", leader_epoch=4, linger=True
        )
        async with serving(follower) as follower_port:
            config = AgentConfig(
                "127.0.0.1",
                follower_port,
                state,
                more_servers=(("127.0.0.1", leader_port),),
                simulate="cpu-only",
                backoff=SLOW,
            )
            agent = Agent(config)
            stop = asyncio.Event()
            running = asyncio.create_task(agent.run(stop))
            try:
                await until(lambda: leader.registers)
                await until(lambda: (state / LEADER_EPOCH_FILE).exists())
            finally:
                stop.set()
                await running
    assert agent.link.stats.redirects == 1
    assert (state / LEADER_EPOCH_FILE).read_text() == "4\n"
    (state / LEADER_EPOCH_FILE).write_text("four\n")
    with pytest.raises(AgentConfigError, match=LEADER_EPOCH_FILE):
        Agent(config)
