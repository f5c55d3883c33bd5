"""The chaos run's separate gateways: their names and arguments (chaoskit.cluster), the
gateway a ``stop-gateway`` hangs (chaoskit.faults), ``--gateways`` and the report's lines."""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import chaos
from bench.chaoskit import cluster, faults, load


def test_the_load_gateways_are_named_in_order_and_each_given_every_server(tmp_path: Path) -> None:
    run = cluster.ChaosCluster(
        tmp_path, ("node-a",), "run",
        servers=cluster.ServerOptions(3, "postgresql://x/y", 3.0), gateways=3,
    )  # fmt: skip
    assert run.load_gateways == ("gateway", "gateway-2", "gateway-3")
    assert list(run.load_gateway_urls) == list(run.load_gateways)
    assert len(set(run.load_gateway_urls.values())) == 3
    for name, url in run.load_gateway_urls.items():
        args = run._args(name)
        assert args[args.index("--server") + 1] == run.grpc
        assert run.grpc.count(",") == 2  # all three servers
        assert args[args.index("--listen") + 1] == url.removeprefix("http://")
    fresh = run.add_gateway("fresh-gateway")
    assert run.load_gateways == ("gateway", "gateway-2", "gateway-3")  # not a load gateway
    assert run.gateways["fresh-gateway"] == fresh
    with pytest.raises(ValueError, match="'gateway-2': a process of the run"):
        run.add_gateway("gateway-2")
    with pytest.raises(ValueError, match="5 gateways: 1 to 4"):
        cluster.ChaosCluster(tmp_path, ("node-a",), "run", gateways=5)
    assert cluster.ChaosCluster(tmp_path, ("node-a",), "run").load_gateways == ("gateway",)


class _Gateways:
    """What FaultLoop asks of the cluster for a gateway fault: the names and their pids."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.load_gateways = tuple(pids)
        self._pids = pids

    def pid(self, name: str) -> int | None:
        return self._pids.get(name)


@pytest.fixture
def sleepers() -> Iterator[dict[str, int]]:
    """Two real processes (each a group leader) standing in for two gateways."""
    procs = {
        name: subprocess.Popen(["sleep", "60"], start_new_session=True)
        for name in ("gateway", "gateway-2")
    }
    yield {name: proc.pid for name, proc in procs.items()}
    for proc in procs.values():
        proc.kill()
        proc.wait(timeout=10)


async def test_stop_gateway_hangs_one_of_the_gateways_drawn_by_the_seed(
    sleepers: dict[str, int],
) -> None:
    config = faults.FaultConfig(stop_s=(0.01, 0.01), kinds=("stop-gateway",))

    async def targets(seed: int) -> list[faults.FaultRecord]:
        loop = faults.FaultLoop(_Gateways(sleepers), config, random.Random(seed))  # type: ignore[arg-type]
        found = [await loop._one("stop-gateway") for _ in range(16)]
        return [r for r in found if r is not None]

    records = await targets(5)
    assert len(records) == 16
    assert all(r.pid == sleepers[r.target] for r in records)  # the target is the one stopped
    assert set(Counter(r.target for r in records)) == {"gateway", "gateway-2"}
    assert [r.target for r in records] == [r.target for r in await targets(5)]
    await asyncio.sleep(0)
    assert not any(_stopped(pid) for pid in sleepers.values())  # each stop had its SIGCONT


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "T"


async def test_with_one_gateway_stop_gateway_draws_nothing(sleepers: dict[str, int]) -> None:
    one = {"gateway": sleepers["gateway"]}
    config = faults.FaultConfig(stop_s=(0.01, 0.01))
    rng, twin = random.Random(9), random.Random(9)
    loop = faults.FaultLoop(_Gateways(one), config, rng)  # type: ignore[arg-type]
    record = await loop._one("stop-gateway")
    assert record is not None and record.target == "gateway"
    twin.uniform(*config.stop_s)  # the hang's length: the only draw
    assert rng.random() == twin.random()


def _options(*argv: str) -> chaos.Options:
    return chaos._options(chaos._parser().parse_args(list(argv)))


def test_gateways_default_to_two_with_several_servers_and_are_bounded() -> None:
    assert _options().gateways == 1
    assert _options("--servers", "3").gateways == 2
    assert _options("--servers", "3", "--gateways", "4").gateways == 4
    assert _options("--gateways", "2").gateways == 2
    for bad in ("0", "5"):
        with pytest.raises(SystemExit, match=f"--gateways {bad}: 1 to 4"):
            _options("--servers", "3", "--gateways", bad)


def test_the_report_says_how_many_gateways() -> None:
    settings = chaos._settings(_options("--servers", "3"), 10, 0, None)
    assert "2 separate `llmgw gateway`s" in settings["cluster"]
    assert "through 2 gateways in turn" in settings["load"]
    single = chaos._settings(_options(), 10, 0, None)
    assert "one separate `llmgw gateway`" in single["cluster"]
    assert "through the gateway," in single["load"]
    records = [
        load.RequestRecord(0.0, 1.0, "chat", False, True, 200, gateway="gateway"),
        load.RequestRecord(0.0, 1.0, "chat", False, False, 0, "cut", gateway="gateway-2"),
        load.RequestRecord(0.0, 1.0, "chat", False, True, 200, gateway="gateway-2"),
    ]
    assert chaos._through_line(records) == (
        "; through gateway 1 (0 failed), gateway-2 2 (1 failed)"
    )
    assert chaos._through_line(records[:1]) == ""
