"""Deployments the autoscaler owns (autoscale mode "act") through ControlService: an apply
keeps the stored count within the new bounds, a new one starts at min, a count in the
request is refused, and ``llmgw scale``/start are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    AutoscalePolicy,
    Deployment,
    DescribeRequest,
    EngineProfile,
    ReplicaRequest,
    ScaleRequest,
)
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService

PROFILE = '[profiles.p]\nengine = "sim"\ngpu_class = "H100"\nmodel_path = "/models/chat"\n'


def document(policy: str, deployment: str = "") -> str:
    return (
        f'{PROFILE}[deployments.chat]\nprofile = "p"\n{deployment}'
        f"[deployments.chat.autoscale]\nttft_p90_ms = 800\n{policy}"
    )


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[ControlService]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield ControlService(plane)


async def apply(service: ControlService, text: str, *, dry_run: bool = False) -> str:
    result = await service.apply_deployment(ApplyDeploymentRequest(document=text, dry_run=dry_run))
    return result.message


async def stored_count(service: ControlService) -> int:
    (row,) = await service.plane.store.load_deployments()
    return Deployment.parse(row.deployment).replicas


async def autoscaler_sets(service: ControlService, n: int) -> None:
    """What the autoscale loop does: a live edit of the count (the path of llmgw scale)."""

    def edit(deployment: Deployment) -> None:
        deployment.replicas = n

    assert await service.plane.desired.update("chat", edit) is not None


async def test_a_new_deployment_starts_at_min(service: ControlService) -> None:
    message = await apply(service, document("min = 2\nmax = 5\n"))
    assert "deployment chat applied: profile p" in message and "2 replicas" in message
    assert await stored_count(service) == 2
    assert service.plane.desired.deployments["chat"].autoscale == AutoscalePolicy(
        min=2, max=5, ttft_p90_ms=800, scale_down_after_s=300, mode="act"
    )


async def test_a_reapply_keeps_the_autoscalers_count_within_the_new_bounds(
    service: ControlService,
) -> None:
    await apply(service, document("min = 1\nmax = 5\n"))
    await autoscaler_sets(service, 4)
    assert "4 replicas" in await apply(service, document("min = 1\nmax = 5\n"))
    assert await stored_count(service) == 4
    dry = await service.apply_deployment(
        ApplyDeploymentRequest(document=document("min = 1\nmax = 3\n"), dry_run=True)
    )
    assert dry.desired == 3 and await stored_count(service) == 4  # a dry run changes nothing
    await apply(service, document("min = 1\nmax = 3\n"))
    assert await stored_count(service) == 3
    await apply(service, document("min = 5\nmax = 6\n"))
    assert await stored_count(service) == 5


async def test_a_fixed_deployment_taken_over_keeps_its_count(service: ControlService) -> None:
    await apply(service, f'{PROFILE}[deployments.chat]\nprofile = "p"\nreplicas = 3\n')
    await apply(service, document("min = 1\nmax = 8\n"))
    assert await stored_count(service) == 3


async def test_advise_mode_counts_are_the_files(service: ControlService) -> None:
    await apply(service, document('min = 1\nmax = 5\nmode = "advise"\n', "replicas = 2\n"))
    await autoscaler_sets(service, 4)
    await apply(service, document('min = 1\nmax = 5\nmode = "advise"\n', "replicas = 2\n"))
    assert await stored_count(service) == 2
    result = await service.scale_deployment(ScaleRequest(deployment="chat", replicas=3))
    assert result.ok and await stored_count(service) == 3


async def test_replicas_beside_act_is_refused_naming_both_keys(service: ControlService) -> None:
    with pytest.raises(GRPCError) as caught:
        await apply(service, document("min = 1\nmax = 5\n", "replicas = 2\n"))
    assert caught.value.status is Status.INVALID_ARGUMENT
    why = str(caught.value.message)
    assert "deployments.chat.replicas" in why and "[deployments.chat.autoscale]" in why
    assert await service.plane.store.load_deployments() == []


async def test_a_structured_request_with_a_count_in_act_mode_is_refused(
    service: ControlService,
) -> None:
    profile = EngineProfile(name="p", engine="sim", gpu_class="H100", model_path="/models/chat")
    policy = AutoscalePolicy(min=1, max=4, ttft_p90_ms=800, mode="act")
    deployment = Deployment(name="chat", profile="p", replicas=3, autoscale=policy)
    with pytest.raises(GRPCError) as caught:
        await service.apply_deployment(
            ApplyDeploymentRequest(deployment=deployment, profiles=[profile])
        )
    assert "deployments.chat.replicas: set together with" in str(caught.value.message)
    deployment.replicas = 0  # unset: the autoscaler's
    result = await service.apply_deployment(
        ApplyDeploymentRequest(deployment=deployment, profiles=[profile])
    )
    assert result.ok and await stored_count(service) == 1


async def test_scale_and_start_of_an_autoscaled_deployment_are_refused(
    service: ControlService,
) -> None:
    await apply(service, document("min = 1\nmax = 5\n"))
    for call in (
        service.scale_deployment(ScaleRequest(deployment="chat", replicas=4)),
        service.start_replica(ReplicaRequest(deployment="chat")),
    ):
        with pytest.raises(GRPCError) as caught:
            await call
        assert caught.value.status is Status.FAILED_PRECONDITION
        why = str(caught.value.message)
        assert "chat is autoscaled (mode act, [1, 5])" in why
        assert "autoscale.min/max" in why and 'autoscale.mode = "advise"' in why
    assert await stored_count(service) == 1
    audit = [r.result for r in await service.plane.store.recent_audit()]
    assert sum(r.startswith("refused: deployment chat is autoscaled") for r in audit) == 2


async def test_describe_answers_the_policy_with_the_computed_status(
    service: ControlService,
) -> None:
    await apply(service, document("min = 2\nmax = 5\n", "priority = 3\n"))
    description = await service.describe(DescribeRequest(kind="deployment", name="chat"))
    deployment = description.deployment
    assert deployment is not None and deployment.priority == 3
    assert deployment.autoscale is not None and deployment.autoscale.max == 5
    assert deployment.status is not None and deployment.status.desired == 2
