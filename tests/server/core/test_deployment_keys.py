"""``[deployments.NAME]`` with its autoscale policy and priority: reading, refusal by key
path, writing back, and the count an apply keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import AutoscalePolicy, Deployment
from llmgw.server.core.deployment_keys import is_act, kept_count
from llmgw.server.core.profiles import Document, parse_document, render_document
from llmgw.server.errors import ProfileError

PROFILE = '[profiles.p]\nengine = "sim"\ngpu_class = "H100"\nmodel_path = "/models/chat"\n'


def doc(deployment: str = "", autoscale: str | None = None) -> str:
    text = PROFILE + '[deployments.chat]\nprofile = "p"\n' + deployment
    if autoscale is not None:
        text += "[deployments.chat.autoscale]\n" + autoscale
    return text


def problems_of(text: str) -> tuple[str, ...]:
    with pytest.raises(ProfileError) as caught:
        parse_document(text)
    return caught.value.problems


def test_the_issue_policy_reads_with_its_values() -> None:
    policy = 'min = 0\nmax = 8\nttft_p90_ms = 800\nscale_down_after_s = 300\nmode = "act"\n'
    d = parse_document(doc("priority = 5\n", policy)).deployments["chat"]
    assert d.autoscale == AutoscalePolicy(
        min=0, max=8, ttft_p90_ms=800, itl_p90_ms=0, scale_down_after_s=300, mode="act"
    )
    assert (d.priority, d.replicas) == (5, 0)  # act: a new deployment starts at min


def test_defaults_min_1_mode_act_five_minutes() -> None:
    d = parse_document(doc(autoscale="max = 3\nitl_p90_ms = 40\n")).deployments["chat"]
    assert d.autoscale == AutoscalePolicy(
        min=1, max=3, itl_p90_ms=40, scale_down_after_s=300, mode="act"
    )
    assert d.replicas == 1 and d.priority == 0 and is_act(d)


def test_advise_keeps_the_files_count() -> None:
    policy = 'min = 1\nmax = 4\nttft_p90_ms = 500\nmode = "advise"\n'
    d = parse_document(doc("replicas = 3\n", policy)).deployments["chat"]
    assert d.replicas == 3 and not is_act(d)


def test_no_policy_is_a_fixed_count() -> None:
    d = parse_document(doc("replicas = 2\n")).deployments["chat"]
    assert d.autoscale is None and d.replicas == 2 and not is_act(d)


def test_replicas_with_act_is_refused_naming_both_keys() -> None:
    (problem,) = problems_of(doc("replicas = 2\n", "max = 3\nttft_p90_ms = 800\n"))
    assert problem.startswith("deployments.chat.replicas: set together with ")
    assert "[deployments.chat.autoscale]" in problem and 'mode = "advise"' in problem


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("ttft_p90_ms = 800\n", "deployments.chat.autoscale.max: required"),
        ("max = 0\nttft_p90_ms = 800\n", "deployments.chat.autoscale.max: must be a positive"),
        (
            "min = 3\nmax = 2\nttft_p90_ms = 8\n",
            "deployments.chat.autoscale.max: must be at least min (3), got 2",
        ),
        (
            "min = -1\nmax = 2\nttft_p90_ms = 8\n",
            "deployments.chat.autoscale.min: must be an integer from 0",
        ),
        (
            "max = 20000\nttft_p90_ms = 8\n",
            "deployments.chat.autoscale.max: must be a positive integer up to 10,000, got 20000",
        ),
        ("max = 2\n", "deployments.chat.autoscale.ttft_p90_ms: set a latency target"),
        (
            "max = 2\nttft_p90_ms = 0\n",
            "deployments.chat.autoscale.ttft_p90_ms: must be a positive integer up to 600,000",
        ),
        (
            "max = 2\nitl_p90_ms = 60001\n",
            "deployments.chat.autoscale.itl_p90_ms: must be a positive integer up to 60,000",
        ),
        (
            "max = 2\nttft_p90_ms = 1.5\n",
            "deployments.chat.autoscale.ttft_p90_ms: must be a positive integer",
        ),
        (
            "max = 2\nttft_p90_ms = 8\nscale_down_after_s = -5\n",
            "deployments.chat.autoscale.scale_down_after_s: must be an integer from 0 up to 86,400",
        ),
        (
            'max = 2\nttft_p90_ms = 8\nmode = "auto"\n',
            'deployments.chat.autoscale.mode: must be "act" or "advise", got "auto"',
        ),
        (
            "max = 2\nttft_p90_ms = 8\nmaximum = 3\n",
            "deployments.chat.autoscale.maximum: unknown key",
        ),
        (
            "max = true\nttft_p90_ms = 8\n",
            "deployments.chat.autoscale.max: must be a positive integer up to 10,000, got true",
        ),
    ],
)
def test_bad_policies_are_refused_by_key_path(policy: str, expected: str) -> None:
    problems = problems_of(doc(autoscale=policy))
    assert any(p.startswith(expected) for p in problems), problems


def test_autoscale_must_be_a_table_and_priority_bounded() -> None:
    text = PROFILE + '[deployments.chat]\nprofile = "p"\nautoscale = 3\npriority = 5000\n'
    assert set(problems_of(text)) == {
        "deployments.chat.autoscale: must be a table, got 3",
        "deployments.chat.priority: must be an integer from -1000 up to 1,000, got 5000",
    }


def test_every_problem_of_a_bad_policy_is_named_at_once() -> None:
    problems = problems_of(doc("replicas = 1\n", 'min = 4\nmax = 2\nmode = "x"\n'))
    assert {p.split(":")[0] for p in problems} == {
        "deployments.chat.autoscale.max",
        "deployments.chat.autoscale.ttft_p90_ms",
        "deployments.chat.autoscale.mode",
    }  # a bad policy's mode is unknown: replicas is not judged against it


def test_render_writes_the_policy_table_and_reads_back() -> None:
    text = doc("priority = -3\n", "min = 0\nmax = 8\nitl_p90_ms = 30\n")
    document = parse_document(text)
    rendered = render_document(document)
    assert "[deployments.chat.autoscale]\nmin = 0\nmax = 8\nitl_p90_ms = 30\n" in rendered
    assert "replicas" not in rendered and "priority = -3" in rendered
    assert parse_document(rendered) == document


def test_a_request_with_a_count_in_act_mode_is_refused() -> None:
    """What a structured request carries is rendered, then read (state.desired): a count
    other than unset or min is written, and the reading refuses it."""
    policy = AutoscalePolicy(min=1, max=3, ttft_p90_ms=800, mode="act")
    for replicas, refused in ((0, False), (1, False), (2, True)):
        d = Deployment(name="chat", profile="p", replicas=replicas, autoscale=policy)
        text = PROFILE + render_document(Document({}, {"chat": d}))
        if refused:
            assert problems_of(text)[0].startswith("deployments.chat.replicas: set together")
        else:
            assert parse_document(text).deployments["chat"].replicas == 1


@pytest.mark.parametrize(
    ("stored", "low", "high", "kept"),
    [(None, 2, 5, 2), (None, 0, 5, 0), (4, 1, 5, 4), (7, 1, 5, 5), (0, 1, 5, 1), (3, 3, 3, 3)],
)
def test_kept_count_is_the_stored_count_within_the_new_bounds(
    stored: int | None, low: int, high: int, kept: int
) -> None:
    policy = AutoscalePolicy(min=low, max=high, ttft_p90_ms=800, mode="act")
    applied = Deployment(name="chat", profile="p", replicas=low, autoscale=policy)
    before = None if stored is None else Deployment(name="chat", replicas=stored)
    assert kept_count(applied, before) == kept


def test_kept_count_of_advise_and_fixed_is_the_applied_count() -> None:
    advise = AutoscalePolicy(min=1, max=3, ttft_p90_ms=800, mode="advise")
    before = Deployment(name="chat", replicas=3)
    assert kept_count(Deployment(name="chat", replicas=2, autoscale=advise), before) == 2
    assert kept_count(Deployment(name="chat", replicas=5), before) == 5


POLICIES = st.builds(
    lambda low, extra, ttft, itl, after, mode: AutoscalePolicy(
        min=low,
        max=max(low, 1) + extra,
        ttft_p90_ms=ttft,
        itl_p90_ms=itl,
        scale_down_after_s=after,
        mode=mode,
    ),  # fmt: skip
    st.integers(0, 50),
    st.integers(0, 50),
    st.integers(0, 600_000),
    st.integers(1, 60_000) | st.just(0),
    st.integers(0, 86_400),
    st.sampled_from(["act", "advise"]),
).filter(lambda p: p.ttft_p90_ms or p.itl_p90_ms)


@settings(max_examples=100, deadline=None)
@given(POLICIES, st.integers(-1000, 1000), st.integers(0, 100))
def test_any_valid_policy_round_trips(policy: AutoscalePolicy, priority: int, count: int) -> None:
    replicas = policy.min if policy.mode == "act" else count
    d = Deployment(name="chat", profile="p", replicas=replicas, priority=priority, autoscale=policy)
    text = PROFILE + render_document(Document({}, {"chat": d}))
    assert parse_document(text).deployments["chat"] == d
