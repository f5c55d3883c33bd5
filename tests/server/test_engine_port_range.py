"""``llmgw server --engine-ports``: from the flag to the reconciler, and what a range means.

The flag is parsed and refused with a clear line; the range reaches ``ServerConfig`` and the
reconcile loop; every engine port placed is inside it (also for nodes sharing one host);
two clusters given different ranges never hand out the same port (with the same range they
do: that is the collision the flag exists for); and a server restarted with another range
leaves its running replicas on their ports, placing only new ones in the new range.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    ControlMessage,
    Deployment,
    EngineProfile,
    Register,
    ShardState,
    ShardStatus,
    StartShard,
)
from llmgw.cli import serve
from llmgw.cli.flags import engine_ports_flag
from llmgw.cli.main import build_parser, main
from llmgw.engineports import DEFAULT_ENGINE_PORTS, PortRange
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server import app
from llmgw.server.app import ServerConfig
from llmgw.server.reconcile_loop import ReconcileLoop
from llmgw.server.state.desired import check_apply
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store

PROFILE = EngineProfile(
    name="one-gpu", engine="sim", gpu_class="H100", tp=1, model_path="/m/chat",
    served_model_name="chat",
)  # fmt: skip
NODES = ("a1", "a2")  # simulated DGX nodes, both on one host (one port space)

# --- the flag ------------------------------------------------------------------------------


def test_the_flag_defaults_to_the_default_range_and_parses() -> None:
    args = build_parser().parse_args(["server"])
    assert engine_ports_flag(args.engine_ports) == DEFAULT_ENGINE_PORTS == (20000, 29999)
    assert engine_ports_flag("30000-30199") == (30000, 30199)
    assert engine_ports_flag(None) is None  # llmgw demo: not given


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("30000", "'30000' is not LO-HI (for example 20000-29999)"),
        ("29999-20000", "'29999-20000': the first port 29999 is above the last 20000"),
        ("80-8080", "'80-8080' is outside 1024-65535"),
        ("30000-30000", "'30000-30000' has 1 port; at least 2"),
    ],
)
@pytest.mark.parametrize("command", ["server", "demo"])
def test_a_bad_range_is_one_clear_line_and_starts_nothing(
    command: str, value: str, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "server.db"
    extra = ["--db", str(db)] if command == "server" else ["--state-dir", str(tmp_path / "d")]
    assert main([command, "--engine-ports", value, *extra]) == 1
    assert capsys.readouterr().err.strip() == f"llmgw: --engine-ports {why}"
    assert not db.exists() and not (tmp_path / "d").exists()


def test_the_range_reaches_the_server_config_and_its_reconcile_loop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    configs: list[ServerConfig] = []

    async def fake_run_server(config: ServerConfig) -> None:
        configs.append(config)

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    args = build_parser().parse_args(
        ["server", "--engine-ports", "31000-31099", "--db", str(tmp_path / "s.db")]
    )
    assert serve.run_server_command(args) == 0
    (config,) = configs
    assert config.engine_ports == (31000, 31099)
    agents: Any = SimpleNamespace(send=None)
    loop = app._reconcile_loop(config, _plane_stub(), agents)
    assert loop is not None and loop.port_range == (31000, 31099)
    default = ServerConfig(config.grpc_listen, config.http_listen, config.db_path)
    assert default.engine_ports == DEFAULT_ENGINE_PORTS


def _plane_stub() -> Any:
    return SimpleNamespace(reconcile_soon=None)


# --- placement through the reconcile loop ---------------------------------------------------


class Agents:
    """Accepts every command for the nodes, and keeps the StartShards."""

    def __init__(self) -> None:
        self.starts: list[tuple[str, StartShard]] = []

    async def send(self, node_id: str, message: ControlMessage) -> bool:
        if message.start_shard is not None:
            self.starts.append((node_id, message.start_shard))
        return True

    def ports(self) -> list[int]:
        return [start.port for _, start in self.starts]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    async with Store(tmp_path / "server.db") as opened:
        yield opened


async def _plane(store: Store, *running: tuple[str, StartShard]) -> ControlPlane:
    """A plane over ``store`` with NODES registered from one host, reporting ``running``."""
    plane = ControlPlane(store)
    await plane.load()
    for node_id in NODES:
        node = simulated_node("dgx-h100", node_id=node_id, hostname=node_id)
        shards = [_ready(start) for n, start in running if n == node_id]
        message = Register(protocol_version=PROTOCOL_VERSION, node=node, shards=shards)
        await plane.register(node, message, peer="127.0.0.1:5000")
    return plane


def _ready(start: StartShard) -> ShardStatus:
    return ShardStatus(
        shard_id=start.shard_id,
        replica_id=start.replica_id,
        state=ShardState.READY,
        endpoint=f"http://127.0.0.1:{start.port}",
        profile_fingerprint=start.profile_fingerprint,
        gpu_uuids=start.gpu_uuids,
    )


async def _apply(plane: ControlPlane, replicas: int) -> None:
    deployment = Deployment(name="chat", profile=PROFILE.name, replicas=replicas)
    request = ApplyDeploymentRequest(deployment=deployment, profiles=[PROFILE])
    await plane.desired.apply(check_apply(request, plane.desired.profiles))


async def _placed_ports(store: Store, port_range: PortRange, replicas: int) -> list[int]:
    plane = await _plane(store)
    agents = Agents()
    loop = ReconcileLoop(plane, agents.send, port_range=port_range)
    await _apply(plane, replicas)
    await loop.round()
    assert len(agents.starts) == replicas
    return agents.ports()


async def test_every_engine_port_is_in_the_range_even_for_nodes_on_one_host(
    store: Store,
) -> None:
    ports = await _placed_ports(store, (41000, 41011), 12)
    assert sorted(ports) == list(range(41000, 41012))  # the lowest first, none twice


async def test_a_range_too_small_leaves_replicas_unplaced_saying_so(store: Store) -> None:
    plane = await _plane(store)
    agents = Agents()
    loop = ReconcileLoop(plane, agents.send, port_range=(41000, 41001))
    await _apply(plane, 3)
    await loop.round()
    assert sorted(agents.ports()) == [41000, 41001]
    assert "no free engine port in 41000-41001" in loop.unplaceable["chat"]


async def test_two_clusters_with_different_ranges_never_share_a_port(tmp_path: Path) -> None:
    async with Store(tmp_path / "one.db") as one, Store(tmp_path / "two.db") as two:
        first = await _placed_ports(one, (42000, 42199), 10)
        second = await _placed_ports(two, (42200, 42399), 10)
    assert set(first).isdisjoint(second)
    assert all(42000 <= p <= 42199 for p in first) and all(42200 <= p <= 42399 for p in second)


async def test_two_clusters_with_the_same_range_collide(tmp_path: Path) -> None:
    """What the flag is for: the same range hands out the same ports first."""
    async with Store(tmp_path / "one.db") as one, Store(tmp_path / "two.db") as two:
        first = await _placed_ports(one, DEFAULT_ENGINE_PORTS, 3)
        second = await _placed_ports(two, DEFAULT_ENGINE_PORTS, 3)
    assert sorted(first) == sorted(second) == [20000, 20001, 20002]


# --- a restart with another range -----------------------------------------------------------


async def test_a_new_range_moves_no_running_replica_and_places_new_ones_in_it(
    tmp_path: Path,
) -> None:
    db = tmp_path / "server.db"
    async with Store(db) as store:
        plane = await _plane(store)
        agents = Agents()
        loop = ReconcileLoop(plane, agents.send, port_range=(43000, 43099))
        await _apply(plane, 3)
        await loop.round()
        running = list(agents.starts)
        for node_id, start in running:
            plane.shard_status(node_id, _ready(start))
        await loop.round()
        await plane.flush()
    before = {start.replica_id: start.port for _, start in running}
    assert sorted(before.values()) == [43000, 43001, 43002]

    async with Store(db) as store:  # the server restarted with --engine-ports 44000-44099
        plane = await _plane(store, *running)
        agents = Agents()
        sent: list[ControlMessage] = []

        async def send(node_id: str, message: ControlMessage) -> bool:
            sent.append(message)
            return await agents.send(node_id, message)

        loop = ReconcileLoop(plane, send, port_range=(44000, 44099))
        await loop.round()
        await loop.round()
        assert sent == []  # nothing stopped, drained or started again
        ports = {r: rec.plan.leader.port for r, rec in plane.replicas.items()}
        assert ports == before
        assert {r.endpoint for r in plane.snapshot().replicas} == {
            f"http://127.0.0.1:{p}" for p in before.values()
        }

        await _apply(plane, 5)
        await loop.round()
        assert sorted(agents.ports()) == [44000, 44001]  # only the new ones, in the new range
        assert {r: rec.plan.leader.port for r, rec in plane.replicas.items() if r in before} == (
            before
        )
