"""Fuzzing profile files and ApplyDeployment requests past what tests/server/core/test_profiles.py
already throws at ``parse_document`` (any text, any TOML structure): byte-level mutations of
real documents, and structured ``EngineProfile``/``Deployment`` messages of any content
through ``check_apply`` (which renders them to TOML and parses that back) and the dry run.

What must hold: a ``Document`` or ``Change`` comes back, or ``ProfileError`` with problems
that are non-empty lines and a refusal that fits one gRPC message; what comes back renders
to TOML that parses to the same thing; nothing else is ever raised.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import pytest
from fuzzkit import examples, wire_message
from hypothesis import event, example, given
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import (
    ApplyDeploymentRequest,
    Deployment,
    EngineProfile,
    LoraAdapter,
)
from llmgw.server.core.applyplan import Action, plan_apply
from llmgw.server.core.fingerprint import profile_fingerprint
from llmgw.server.core.placement import FleetPlacer
from llmgw.server.core.profiles import Document, parse_document, render_document
from llmgw.server.core.reconcile_state import ReconcileInput
from llmgw.server.errors import ProfileError
from llmgw.server.state.desired import (
    MESSAGE_LIMIT,
    check_apply,
    parse_with_profiles,
    refusal,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

DATA = Path(__file__).parents[1] / "data" / "profiles"
DOCUMENTS = {p.name: p.read_text() for p in sorted(DATA.glob("*.toml"))}
GOOD = {name: parse_document(text) for name, text in DOCUMENTS.items() if name.startswith("good")}
STORED = dict(GOOD["good-fleet.toml"].profiles)


def refused_well(exc: ProfileError) -> None:
    assert exc.problems and all(isinstance(p, str) and p.strip() for p in exc.problems)
    assert len(refusal(exc)) <= MESSAGE_LIMIT


def round_trips(document: Document) -> None:
    assert parse_document(render_document(document)) == document


# --- documents -----------------------------------------------------------------------------

_SPICE = st.sampled_from(
    ['"', "'", "[", "]", "{", "}", "=", "\n", "\\", "#", ".", ",", "\x00", "\x7f", "é", "\ud7ff",
     '"""', "'''", "[[", "]]", "\\u0000", "\\U0010ffff", "1e999", "0x", "inf", "nan", "-0",
     "9" * 30, "true", "\r", "\t", "tp = ", "[profiles.", "[deployments."]
)  # fmt: skip


@st.composite
def mutated_documents(draw: st.DrawFn) -> str:
    """A real document with a few TOML-shaped pieces inserted, deleted or replaced."""
    text = draw(st.sampled_from(sorted(DOCUMENTS.values())))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        kind = draw(st.sampled_from(["insert", "delete", "replace", "duplicate"]))
        if kind == "insert":
            text = text[:at] + draw(_SPICE | st.text(max_size=4)) + text[at:]
        elif kind == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 20)) :]
        elif kind == "replace":
            text = text[:at] + draw(_SPICE) + text[at + 1 :]
        else:
            text = text[:at] + text[at : at + draw(st.integers(1, 60))] * 2 + text[at:]
    return text


@examples(300)
@given(mutated_documents())
@example('[profiles.a]\nengine = "sim"\nargs = [' * 1 + "[" * 5000)  # deep arrays
@example("[profiles.a]\ntp = " + "9" * 5000)  # an integer past Python's digit limit
def test_mutated_documents_parse_or_are_refused_with_every_problem(text: str) -> None:
    try:
        document = parse_document(text)
    except ProfileError as exc:
        refused_well(exc)
        event("refused")
    else:
        round_trips(document)
        event("parsed")
    try:
        parse_with_profiles(text, STORED)
    except ProfileError as exc:
        refused_well(exc)


# --- ApplyDeployment requests --------------------------------------------------------------

_TEXT = st.text(max_size=12) | _SPICE
_NAMES = st.sampled_from(["chat", "a", "chat-tp2", "", "A", "a.b", "-a", "x" * 64]) | _TEXT
_SIZES = st.sampled_from([0, 1, 2, 3, 8, 1024, 1025, 2**32 - 1])


@st.composite
def profiles(draw: st.DrawFn) -> EngineProfile:
    """A profile close to a valid one, with some fields of any content."""
    base = EngineProfile.parse(bytes(STORED[draw(st.sampled_from(sorted(STORED)))]))
    for name in draw(st.lists(st.sampled_from(_PROFILE_FIELDS), max_size=3)):
        setattr(base, name, draw(_field_values(name)))
    return base


_PROFILE_FIELDS = sorted(EngineProfile._betterproto.meta_by_field_name)  # type: ignore[arg-type]


def _field_values(name: str) -> st.SearchStrategy[object]:
    kind = EngineProfile._betterproto.meta_by_field_name[name]  # type: ignore[arg-type]
    if kind.proto_type == "string":
        return _NAMES if name == "name" else _TEXT
    if kind.proto_type == "bool":
        return st.booleans()
    if kind.proto_type == "map":
        return st.dictionaries(_TEXT, _TEXT, max_size=3)
    if kind.repeated and kind.proto_type == "message":
        return st.lists(st.builds(LoraAdapter, _TEXT, _TEXT), max_size=3)
    if kind.repeated:
        return st.lists(_TEXT, max_size=3)
    if kind.proto_type == "uint64":
        return _SIZES | st.integers(0, 2**64 - 1)
    return _SIZES


_VALID_NAMES = st.sampled_from(["chat", "web-1", "a.b", "x" * 63])
_DEPLOYMENTS = st.builds(
    Deployment,
    name=st.one_of(_VALID_NAMES, _VALID_NAMES, _NAMES),
    profile=st.one_of(st.sampled_from(sorted(STORED)), st.sampled_from(sorted(STORED)), _NAMES),
    replicas=_SIZES,
    pool=st.one_of(st.just(""), st.just(""), _NAMES),
    labels=st.dictionaries(_TEXT, _TEXT, max_size=2),
)
_REQUESTS = st.builds(
    ApplyDeploymentRequest,
    deployment=st.none() | _DEPLOYMENTS,
    profiles=st.lists(profiles(), max_size=3),
    dry_run=st.booleans(),
    document=st.one_of(
        st.just(""), st.just(""), st.sampled_from(sorted(DOCUMENTS.values())), mutated_documents()
    ),
)


def check(request: ApplyDeploymentRequest, stored: dict[str, EngineProfile]) -> None:
    try:
        change = check_apply(request, MappingProxyType(stored))
    except ProfileError as exc:
        refused_well(exc)
        event("refused")
        return
    event("applied")
    brought = {p.name: p for p in change.profiles}
    deployments = {change.deployment.name: change.deployment} if change.deployment else {}
    text = render_document(Document(MappingProxyType(brought), MappingProxyType(deployments)))
    again = parse_with_profiles(text, stored)  # a deployment may use a stored profile
    assert (again.profiles, again.deployments) == (brought, deployments)
    if change.deployment is not None:
        assert change.profile is not None
        assert change.profile.name == change.deployment.profile
        assert len(_planned_on_no_nodes(change.deployment, change.profile)) == (
            change.deployment.replicas
        )


def _planned_on_no_nodes(deployment: Deployment, profile: EngineProfile) -> list[str]:
    """The dry run's diff of one deployment on a fleet of no nodes: every replica
    unplaceable, naming why."""
    state = ReconcileInput(
        deployments={deployment.name: deployment}, profiles={profile.name: profile},
        fingerprint=profile_fingerprint, place=FleetPlacer([], profile_fingerprint),
        replicas={}, shards={}, nodes={}, pending={}, now=0.0, api_key_for=str,
    )  # fmt: skip
    changes = plan_apply(state, [deployment.name]).changes
    assert all(c.action is Action.UNPLACEABLE and c.reason for c in changes)
    return [c.replica for c in changes]


@examples(250)
@given(_REQUESTS, st.booleans())
def test_any_apply_request_is_a_change_or_a_refusal_naming_its_problems(
    request: ApplyDeploymentRequest, with_stored: bool
) -> None:
    check(request, STORED if with_stored else {})


@examples(200)
@given(wire_message(ApplyDeploymentRequest))
def test_any_well_formed_wire_request_is_a_change_or_a_refusal(data: bytes) -> None:
    """Every field of the message, of any content, as the gRPC decoder hands it over."""
    check(ApplyDeploymentRequest.parse(data), STORED)


def test_the_good_example_still_applies() -> None:
    """The properties above would pass on a check_apply that refused everything."""
    document = GOOD["good-issue-example.toml"]
    (deployment,) = document.deployments.values()
    request = ApplyDeploymentRequest(
        deployment=deployment, profiles=[document.profiles[deployment.profile]]
    )
    change = check_apply(request, {})
    assert change.deployment == deployment
