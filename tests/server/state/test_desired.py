"""Desired state through ControlService: apply, dry run, delete, list, audit, refusals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    DeleteDeploymentRequest,
    Deployment,
    EngineProfile,
    GetClusterRequest,
    ListProfilesRequest,
    Register,
    WatchRequest,
)
from llmgw.cli.apply import _requests
from llmgw.cli.main import main
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.profiles import parse_document
from llmgw.server.errors import ProfileError
from llmgw.server.state.desired import MESSAGE_LIMIT, check_apply, parse_with_profiles
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import OPERATOR, ControlService

# The example, shared with the profile tests.
EXAMPLE = (Path(__file__).parents[2] / "data" / "profiles" / "good-issue-example.toml").read_text()


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[ControlService]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield ControlService(plane)


def _request(
    text: str = EXAMPLE, *, dry_run: bool = False, document: bool = True
) -> ApplyDeploymentRequest:
    doc = parse_document(text)
    (deployment,) = doc.deployments.values()
    profiles = [doc.profiles[deployment.profile]] if deployment.profile in doc.profiles else []
    return ApplyDeploymentRequest(
        deployment=deployment, profiles=profiles, dry_run=dry_run, document=text if document else ""
    )


async def _register(service: ControlService, node_id: str, fixture: str = "dgx-h100") -> None:
    node = simulated_node(fixture, node_id=node_id, hostname=node_id)
    await service.plane.register(node, Register(node=node, protocol_version=1), peer="test")


async def _state(service: ControlService) -> tuple[object, ...]:
    """Everything an apply could change: the stored rows, the memory, the audit log."""
    store = service.plane.store
    cluster = await service.get_cluster(GetClusterRequest())
    return (
        await store.load_profiles(),
        await store.load_deployments(),
        await store.recent_audit(),
        list(cluster.deployments),
        dict(service.plane.desired.profiles),
        service.plane.hub.revision,
    )


async def test_apply_stores_publishes_and_audits(service: ControlService) -> None:
    result = await service.apply_deployment(_request())
    assert result.ok and "deployment chat applied" in result.message
    cluster = await service.get_cluster(GetClusterRequest())
    (deployment,) = cluster.deployments
    assert (deployment.name, deployment.profile, deployment.replicas) == ("chat", "chat-tp2", 2)
    assert deployment.updated_unix_ms > 0
    (stored,) = await service.plane.store.load_profiles()
    assert stored.name == "chat-tp2"
    assert stored.fingerprint == profile_fingerprint(parse_document(EXAMPLE).profiles["chat-tp2"])
    (audit,) = await service.plane.store.recent_audit()
    assert (audit.actor, audit.action, audit.target) == (OPERATOR, "apply", "deployment/chat")
    assert audit.result.startswith("ok")
    assert [e.target for e in cluster.events] == ["deployment/chat"]
    listed = await service.list_profiles(ListProfilesRequest())
    assert [p.name for p in listed.profiles] == ["chat-tp2"]


async def test_watch_sees_deployment_and_audit(service: ControlService) -> None:
    stream = service.watch(WatchRequest())
    first = await anext(stream)
    assert first.snapshot is not None and not first.snapshot.deployments
    await service.apply_deployment(_request())
    deployment, audit = await anext(stream), await anext(stream)
    await service.delete_deployment(DeleteDeploymentRequest(name="chat"))
    removed = await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert deployment.deployment is not None and deployment.deployment.name == "chat"
    assert audit.audit is not None and audit.audit.target == "deployment/chat"
    assert removed.deployment_removed == "chat"


async def test_dry_run_plans_on_the_inventory_and_changes_nothing(service: ControlService) -> None:
    await _register(service, "a1")
    before = await _state(service)
    result = await service.apply_deployment(_request(dry_run=True))
    assert await _state(service) == before
    assert "nothing was changed" in result.message and result.plan is not None
    assert result.plan.placeable and (result.desired, result.placeable) == (2, 2)
    # two TP=2 replicas on one DGX: named as the reconciler names them, on a1, each on its
    # own GPU pair, on its own port
    changes = result.plan.changes
    assert [(c.action, c.replica, c.node) for c in changes] == [
        ("add", "chat-1", "a1"),
        ("add", "chat-2", "a1"),
    ]
    assert len({g for c in changes for g in c.gpus}) == 4
    assert [c.port for c in changes] == [20000, 20001]


async def test_dry_run_says_why_it_cannot_place(service: ControlService) -> None:
    await _register(service, "c1", "cpu-only")
    result = await service.apply_deployment(_request(dry_run=True))
    assert result.plan is not None and not result.plan.placeable
    first = result.plan.changes[0]
    assert (first.action, first.replica) == ("unplaceable", "chat-1") and "H100" in first.reason
    assert "cannot be placed" in result.message and result.placeable == 0


async def test_unknown_profile_is_refused_by_name_and_audited(service: ControlService) -> None:
    request = ApplyDeploymentRequest(
        deployment=Deployment(name="chat", profile="ghost", replicas=1)
    )
    with pytest.raises(GRPCError) as caught:
        await service.apply_deployment(request)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert "deployments.chat.profile" in str(caught.value.message) and "ghost" in str(
        caught.value.message
    )
    assert not await service.plane.store.load_deployments()
    (audit,) = await service.plane.store.recent_audit()
    assert audit.target == "deployment/chat" and audit.result.startswith("refused: ")


async def test_a_stored_profile_can_be_used_without_bringing_it(service: ControlService) -> None:
    await service.apply_deployment(_request())
    text = '[deployments.batch]\nprofile = "chat-tp2"\nreplicas = 1\n'
    request = ApplyDeploymentRequest(
        deployment=Deployment(name="batch", profile="chat-tp2", replicas=1), document=text
    )
    result = await service.apply_deployment(request)
    assert result.ok
    assert sorted(service.plane.desired.deployments) == ["batch", "chat"]


async def test_bad_structured_fields_are_refused_with_key_paths(service: ControlService) -> None:
    bad = EngineProfile(name="p", engine="nope", gpu_class="H100", tp=3, gpus_per_node=2)
    request = ApplyDeploymentRequest(
        deployment=Deployment(name="d", profile="p", replicas=1), profiles=[bad]
    )
    before = await _state(service)
    with pytest.raises(GRPCError) as caught:
        await service.apply_deployment(request)
    message = str(caught.value.message)
    assert "profiles.p.engine" in message and "profiles.p.model_path" in message
    after = await _state(service)
    assert after[:2] == before[:2] and after[3:5] == before[3:5]  # nothing stored


async def test_request_must_match_its_document(service: ControlService) -> None:
    request = _request()
    assert request.deployment is not None
    request.deployment.replicas = 7  # the file says 2
    with pytest.raises(GRPCError, match="differs from the document"):
        await service.apply_deployment(request)
    assert not service.plane.desired.deployments


async def test_refusal_message_is_short_however_bad_the_input(service: ControlService) -> None:
    profiles = [EngineProfile(name=f"p{i}-" + "x" * 50, engine="x" * 5000) for i in range(200)]
    with pytest.raises(GRPCError) as caught:
        await service.apply_deployment(ApplyDeploymentRequest(profiles=profiles))
    assert len(str(caught.value.message)) <= MESSAGE_LIMIT
    assert "and " in str(caught.value.message) and "more" in str(caught.value.message)


async def test_delete_unknown_is_not_found_and_audited(service: ControlService) -> None:
    with pytest.raises(GRPCError) as caught:
        await service.delete_deployment(DeleteDeploymentRequest(name="nope"))
    assert caught.value.status is Status.NOT_FOUND
    (audit,) = await service.plane.store.recent_audit()
    assert (audit.action, audit.target) == ("delete", "deployment/nope")
    assert audit.result.startswith("refused")


async def test_delete_removes_durably(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        service = ControlService(plane)
        await service.apply_deployment(_request())
        await service.delete_deployment(DeleteDeploymentRequest(name="chat"))
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        assert not plane.desired.deployments
        assert list(plane.desired.profiles) == ["chat-tp2"]  # profiles stay
        assert [e.action for e in plane.snapshot().events] == ["apply", "delete"]


def test_parse_with_profiles_borrows_only_what_is_missing() -> None:
    stored = dict(parse_document(EXAMPLE).profiles)
    doc = parse_with_profiles('[deployments.x]\nprofile = "chat-tp2"\n', stored)
    assert not doc.profiles and doc.deployments["x"].profile == "chat-tp2"
    with pytest.raises(ProfileError, match="ghost"):
        parse_with_profiles('[deployments.x]\nprofile = "ghost"\n', stored)


def test_api_profile_defaults_match_the_file() -> None:
    """A profile sent with tp/pp/nodes unset is stored as the file would have it."""
    from_file = parse_document(EXAMPLE).profiles["chat-tp2"]
    sparse = EngineProfile.parse(bytes(from_file))
    sparse.pp = sparse.nodes = sparse.gpus_per_node = 0
    change = check_apply(ApplyDeploymentRequest(profiles=[sparse]), {})
    assert bytes(change.profiles[0]) == bytes(from_file)


def test_cli_refuses_a_bad_file_before_calling_the_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[profiles.p]\nengine = "x"\n\n[deployments.d]\nprofile = "p"\nreplicas = -1\n')
    # port 9 (discard) is never a control server: reaching it would be a different error
    assert main(["apply", "-f", str(bad), "--server", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    for path in ("profiles.p.engine", "profiles.p.gpu_class", "deployments.d.replicas"):
        assert f"bad.toml: {path}: " in err
    assert "cannot reach" not in err


def test_cli_sends_unused_profiles_first_then_each_deployment_with_its_own() -> None:
    text = EXAMPLE + '\n[profiles.spare]\nengine = "sim"\ngpu_class = "cpu"\ncpu_threads = 2\n'
    text += 'model_path = "/m"\n'
    requests = _requests(parse_document(text), text, dry_run=True)
    assert [target for target, _ in requests] == ["profiles spare", "deployment chat"]
    spare, chat = (r for _, r in requests)
    assert spare.deployment is None and [p.name for p in spare.profiles] == ["spare"]
    assert [p.name for p in chat.profiles] == ["chat-tp2"]
    assert chat.dry_run and chat.document == text


# --- a whole document in one request ------------------------------------------------------

TWO = EXAMPLE + (
    '\n[profiles.spare]\nengine = "sim"\ngpu_class = "cpu"\ncpu_threads = 2\nmodel_path = "/m"\n'
    '\n[deployments.more]\nprofile = "chat-tp2"\nreplicas = 1\n'
)


async def test_a_whole_document_is_stored_at_once_with_a_line_and_an_audit_per_change(
    service: ControlService,
) -> None:
    result = await service.apply_deployment(ApplyDeploymentRequest(document=TWO))
    assert result.ok
    lines = result.message.splitlines()
    # no node is registered: stored, and the answer says first that none can be placed
    assert lines[0].startswith("0 of 3 replicas can be placed: deployment chat: no nodes")
    assert lines[1] == "profiles spare stored"
    assert lines[2].startswith("deployment chat applied: profile chat-tp2 (")
    assert lines[3].startswith("deployment more applied: profile chat-tp2 (")
    assert len(lines) == 4 and (result.desired, result.placeable) == (3, 0)
    stored = [Deployment.parse(d.deployment) for d in await service.plane.store.load_deployments()]
    assert {d.name: d.replicas for d in stored} == {"chat": 2, "more": 1}
    assert {p.name for p in await service.plane.store.load_profiles()} == {"chat-tp2", "spare"}
    audits = [(a.action, a.target) for a in await service.plane.store.recent_audit()]
    assert sorted(audits) == [
        ("apply", "deployment/chat"), ("apply", "deployment/more"), ("apply", "profile/spare"),
    ]  # fmt: skip


async def test_a_bad_whole_document_changes_nothing(service: ControlService) -> None:
    bad = TWO.replace("replicas = 1", "replicas = -1")
    before = await _state(service)
    with pytest.raises(GRPCError) as refused:
        await service.apply_deployment(ApplyDeploymentRequest(document=bad, dry_run=True))
    assert refused.value.status is Status.INVALID_ARGUMENT
    assert "document: deployments.more.replicas" in str(refused.value.message)
    assert await _state(service) == before
    dry = await service.apply_deployment(ApplyDeploymentRequest(document=TWO, dry_run=True))
    assert dry.message.startswith("dry run: would store profiles spare")
    assert dry.plan is not None
    assert [(c.action, c.replica) for c in dry.plan.changes] == [
        ("unplaceable", "chat-1"), ("unplaceable", "chat-2"), ("unplaceable", "more-1"),
    ]  # fmt: skip
    assert await _state(service) == before


async def test_the_answer_to_a_huge_document_stays_short(service: ControlService) -> None:
    many = EXAMPLE + "".join(
        f'\n[deployments.d{i}]\nprofile = "chat-tp2"\nreplicas = 0\n' for i in range(300)
    )
    result = await service.apply_deployment(ApplyDeploymentRequest(document=many))
    assert len(result.message) <= MESSAGE_LIMIT
    assert result.message.splitlines()[-1].startswith("… and ")
    assert len(await service.plane.store.load_deployments()) == 301
