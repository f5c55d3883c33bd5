"""An agent started in a folder that holds another ``llmgw`` package (a clone in ``~``):
the simulated engines it starts import the installed llmgw, not that folder."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_kvevents import (
    FakeControl,
    _kill_engines,
    _start_sim_shard,
    control,
    until,
)

from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.daemon import Agent, AgentConfig
from llmgw.agent.shards import RestartPolicy
from llmgw.api.llmgw.v1 import ControlMessage, ShardState

__all__ = ["control"]  # the fixture, used by name

pytestmark = pytest.mark.timeout(90)


async def test_an_engine_started_in_a_folder_with_a_llmgw_package_runs(
    control: tuple[FakeControl, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, port = control
    home = tmp_path / "home"
    (home / "llmgw").mkdir(parents=True)
    (home / "llmgw" / "__init__.py").write_text('"""Not the llmgw you are looking for."""\n')
    monkeypatch.chdir(home)  # the agent's working directory, and so its engines'
    config = AgentConfig(
        "127.0.0.1",
        port,
        tmp_path / "state",
        simulate="cpu-only",
        backoff=BackoffPolicy(base_s=0.05, cap_s=0.2),
        restart=RestartPolicy(base_s=30.0, cap_s=30.0),  # one try is enough to tell
    )
    agent = Agent(config)
    stop = asyncio.Event()
    running = asyncio.create_task(agent.run(stop))
    try:
        await until(lambda: fake.sessions)
        await fake.commands.put(ControlMessage(start_shard=_start_sim_shard()))
        ended = (ShardState.READY, ShardState.FAILED)
        await until(lambda: fake.state("kv1") in ended, 60)
        log = (tmp_path / "state" / "logs" / "kv1.log").read_text()
        assert fake.state("kv1") is ShardState.READY, log[-2000:]
        assert "ImportError" not in log
    finally:
        stop.set()
        await running
        _kill_engines(fake.statuses("kv1"))
