"""Which cluster an agent's engines belong to (``llmgw.agent.cluster``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmgw.agent.cluster import CLUSTER_ID_FILE, ClusterIdError, ClusterMembership

A = "a" * 32
B = "b" * 32


def remembered(state: Path) -> str:
    return (state / CLUSTER_ID_FILE).read_text().strip()


def test_a_first_start_takes_the_servers_id(tmp_path: Path) -> None:
    membership = ClusterMembership(tmp_path)
    assert membership.remembered == ""
    assert membership.registered(A, engines=3)  # state from before cluster ids: handed over
    assert remembered(tmp_path) == A and not membership.holding
    assert ClusterMembership(tmp_path).remembered == A


def test_engines_are_held_from_another_cluster_until_joined(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / CLUSTER_ID_FILE).write_text(A + "\n")
    membership = ClusterMembership(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert not membership.registered(B, engines=2)
    assert membership.holding and membership.holding_for == B
    assert remembered(tmp_path) == A  # unchanged: only an operator changes it
    assert A in caplog.text and f"--join-cluster {B}" in caplog.text
    assert not membership.registered(B, engines=2)  # every session again
    assert membership.registered(A, engines=2)  # the right server again
    assert not membership.holding

    joined = ClusterMembership(tmp_path, join=B)
    assert remembered(tmp_path) == B
    assert joined.registered(B, engines=2) and not joined.holding


def test_an_agent_without_engines_follows_the_server(tmp_path: Path) -> None:
    (tmp_path / CLUSTER_ID_FILE).write_text(A + "\n")
    membership = ClusterMembership(tmp_path)
    assert membership.registered(B, engines=0)
    assert remembered(tmp_path) == B


def test_a_server_without_cluster_ids_gets_the_engines(tmp_path: Path) -> None:
    (tmp_path / CLUSTER_ID_FILE).write_text(A + "\n")
    membership = ClusterMembership(tmp_path)
    assert membership.registered("", engines=2)
    assert remembered(tmp_path) == A


@pytest.mark.parametrize("bad", ["", "xyz", A.upper(), A + "0", "../" + A])
def test_a_malformed_join_cluster_is_refused_naming_the_flag(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ClusterIdError, match="--join-cluster"):
        ClusterMembership(tmp_path, join=bad)
    assert not (tmp_path / CLUSTER_ID_FILE).exists()


def test_a_damaged_remembered_id_is_named(tmp_path: Path) -> None:
    (tmp_path / CLUSTER_ID_FILE).write_text("not an id\n")
    with pytest.raises(ClusterIdError, match=CLUSTER_ID_FILE):
        ClusterMembership(tmp_path)
