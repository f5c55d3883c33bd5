"""llmgw/server/state/deploystatus.py: a status is computed again only when what it stands
on changed (every round asks it of every deployment)."""

from __future__ import annotations

import pytest

from llmgw.api.llmgw.v1 import AutoscalePolicy, AutoscaleStatus, Deployment
from llmgw.server.core.deployment_status import deployment_status
from llmgw.server.state import deploystatus
from llmgw.server.state.deploystatus import DeploymentBoard
from llmgw.server.state.inventory import Inventory


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The deployments ``deployment_status`` was called for, in order."""
    calls: list[str] = []

    def counting(deployment: Deployment, *args: object, **kw: object) -> object:
        calls.append(deployment.name)
        return deployment_status(deployment, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(deploystatus, "deployment_status", counting)
    return calls


def test_an_unchanged_deployment_is_neither_computed_nor_published_again(
    computed: list[str],
) -> None:
    board = DeploymentBoard(Inventory(), lambda name: "fp-1")
    deployments = {n: Deployment(name=n, profile="p", replicas=1) for n in ("a", "b")}
    assert [d.name for d in board.changed(deployments)] == ["a", "b"]
    assert board.changed(deployments) == [] and computed == ["a", "b"]

    board.set_verdicts({"a": "no GPU of class H100 is free"}, ())
    [a] = board.changed(deployments)
    assert a.status is not None and a.status.unplaceable_reason == "no GPU of class H100 is free"
    deployments["b"] = Deployment(name="b", profile="p", replicas=2)  # a scale
    [b] = board.changed(deployments)
    assert b.status is not None and b.status.desired == 2
    assert computed == ["a", "b", "a", "b"]


def test_an_autoscaled_deployment_is_computed_each_time_and_its_policy_removal_shows(
    computed: list[str],
) -> None:
    board = DeploymentBoard(Inventory(), lambda name: "fp-1")
    policy = AutoscalePolicy(min=1, max=3, mode="act")
    scaled = {"c": Deployment(name="c", profile="p", replicas=1, autoscale=policy)}
    board.set_autoscale("c", AutoscaleStatus(mode="act", desired=1, reason="hold"))
    assert len(board.changed(scaled)) == 1
    board.changed(scaled)
    assert computed == ["c", "c"]  # the planner's view changes apart from the inputs
    board.set_autoscale("c", None)
    plain = {"c": Deployment(name="c", profile="p", replicas=1)}
    [c] = board.changed(plain)
    assert c.status is not None and c.status.autoscale is None
