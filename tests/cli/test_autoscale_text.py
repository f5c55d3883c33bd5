"""The autoscaler in ``llmgw get deployments`` and ``llmgw describe deployment``, from
hand-made statuses (the server's loop fills them)."""

from __future__ import annotations

import io

from llmgw.api.llmgw.v1 import (
    AutoscalePolicy,
    AutoscaleStatus,
    Cluster,
    Deployment,
    DeploymentStatus,
    Description,
)
from llmgw.cli.apply import deployment_rows
from llmgw.cli.describe import render_description
from llmgw.cli.getwatch import RowPrinter

POLICY = AutoscalePolicy(min=1, max=8, ttft_p90_ms=800, scale_down_after_s=300, mode="act")
DECIDED = AutoscaleStatus(
    mode="act",
    current=2,
    desired=3,
    reason="scale_up",
    message="ttft p90 1240 ms > target 800 ms on 2 replicas",
    signal="ttft_p90_ms=1240",
    decided_unix_ms=1_700_000_000_000,
    ttft_p90_ms=1240.0,
    itl_p90_ms=-1.0,
    arrival_rps=3.5,
    in_flight=12,
    waiting=0,
    kv_usage=0.41,
    gpu_budget=16,
)


def scaled(status: AutoscaleStatus | None, policy: AutoscalePolicy = POLICY) -> Deployment:
    return Deployment(
        name="chat",
        profile="p",
        replicas=2,
        pool="gpu-a",
        priority=5,
        autoscale=policy,
        status=DeploymentStatus(desired=2, ready=2, up_to_date=2, available=2, autoscale=status),
    )


def test_get_deployments_adds_the_autoscalers_columns_only_when_one_has_a_policy() -> None:
    fixed = Deployment(name="emb", profile="q", replicas=1, status=DeploymentStatus(desired=1))
    assert (
        deployment_rows([fixed])[0][-1] == "REASON"
        and "AUTOSCALE" not in deployment_rows([fixed])[0]
    )
    header, chat, emb = deployment_rows([scaled(DECIDED), fixed])
    assert header[6:] == ["AUTOSCALE", "SIGNAL", "REASON"]
    assert chat[6:8] == ["2→3 scale_up", "ttft_p90_ms=1240"]
    assert emb[6:8] == ["-", "-"]


def test_advise_and_a_policy_not_yet_decided_say_so() -> None:
    advise = AutoscalePolicy(min=1, max=4, itl_p90_ms=50, mode="advise")
    status = AutoscaleStatus(mode="advise", current=1, desired=2, reason="scale_up")
    (_, row) = deployment_rows([scaled(status, advise)])
    assert row[6] == "advise 1→2 scale_up"
    (_, row) = deployment_rows([scaled(None)])
    assert row[6:8] == ["waiting", "-"]


def test_describe_shows_policy_decision_signal_and_window() -> None:
    text = render_description(
        Description(kind="deployment", name="chat", deployment=scaled(DECIDED))
    )
    lines = {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in text.splitlines()[:20]
        if ":" in line
    }
    assert lines["Autoscale"] == "act, 1 to 8 replicas, ttft p90 <= 800 ms, down after 300 s"
    assert lines["Priority"] == "5"
    assert lines["Autoscaler"] == (
        "2 → 3 (scale_up): ttft p90 1240 ms > target 800 ms on 2 replicas"
    )
    assert lines["Signal"] == "ttft_p90_ms=1240"
    assert lines["Window"] == (
        "ttft p90 1240 ms, itl p90 unknown, 3.50 req/s, 12 in flight, 0 waiting, kv 41%"
    )
    assert lines["Decided"].startswith("2023-11-14T22:13:20Z") and lines["Scaled"] == "-"
    assert lines["GPU budget"] == "16 GPUs in pool gpu-a"


def test_describe_of_a_policy_before_its_first_round_and_of_a_fixed_count() -> None:
    text = render_description(Description(kind="deployment", name="chat", deployment=scaled(None)))
    assert "no decision yet" in text and "Signal:" not in text
    fixed = Deployment(name="emb", profile="q", replicas=1)
    text = render_description(Description(kind="deployment", name="emb", deployment=fixed))
    assert "Autoscale" not in text and "Priority" not in text


def test_get_deployments_watch_prints_the_table_again_when_the_autoscalers_columns_appear() -> None:
    out = io.StringIO()
    printer = RowPrinter(lambda cluster: deployment_rows(cluster.deployments), out)
    fixed = Deployment(name="emb", profile="q", replicas=1, status=DeploymentStatus(desired=1))
    printer.show(Cluster(deployments=[fixed]))
    printer.show(Cluster(deployments=[fixed, scaled(DECIDED)]))
    lines = out.getvalue().splitlines()
    assert lines[0].split()[-1] == "REASON" and len(lines) == 5
    assert lines[2].split()[6:8] == ["AUTOSCALE", "SIGNAL"]
    assert lines[4].split()[:1] == ["chat"] and "2→3 scale_up" in lines[4]
