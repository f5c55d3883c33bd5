"""Engines are found again by the mark in their environment (a real child process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from llmgw.agent.marks import CLUSTER_ENV, MARK_ENV, marked_engines, shard_mark
from llmgw.agent.process import read_stat

CLUSTER = "a" * 32


def test_no_node_id_marks_nothing() -> None:
    assert shard_mark("", "s1", "c" * 32) == {}
    assert marked_engines("", "") == []


def test_the_mark_names_the_cluster_once_there_is_one() -> None:
    assert shard_mark("n1", "s1", "") == {MARK_ENV: "n1/s1"}
    assert shard_mark("n1", "s1", "c" * 32) == {MARK_ENV: "n1/s1", CLUSTER_ENV: "c" * 32}


def test_a_marked_session_leader_is_found_and_its_children_and_other_nodes_are_not() -> None:
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"  # noqa: E501
    env = {**os.environ, **shard_mark("mark-test-n1", "r1-0", CLUSTER)}
    leader = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)"],
        env={**os.environ, MARK_ENV: "mark-test-n2/r9-0"},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10  # until the leader's child (marked too) runs
        while len(_session_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_session_members(leader.pid)) == 2
        found = marked_engines("mark-test-n1", CLUSTER)
        assert [(e.shard_id, e.identity.pid) for e in found] == [("r1-0", leader.pid)]
    finally:
        for proc in (leader, other):
            os.killpg(proc.pid, 9)
            proc.wait()


def test_an_engine_of_the_same_node_name_in_another_cluster_is_not_found() -> None:
    """Node names repeat across clusters on one host; only this cluster's engines are ours."""
    marked = {
        "ours": shard_mark("mark-test-n3", "r1-0", CLUSTER),
        "theirs": shard_mark("mark-test-n3", "r2-0", "b" * 32),
        "no cluster": shard_mark("mark-test-n3", "r3-0", ""),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(30)"],
            env={**os.environ, **env},
            start_new_session=True,
        )
        for name, env in marked.items()
    }
    try:
        deadline = time.monotonic() + 10  # until every child has exec'd with its environment
        while time.monotonic() < deadline and len(marked_engines("mark-test-n3", CLUSTER)) < 1:
            time.sleep(0.05)
        ours = marked_engines("mark-test-n3", CLUSTER)
        assert [(e.shard_id, e.identity.pid) for e in ours] == [("r1-0", procs["ours"].pid)]
        unknown = marked_engines("mark-test-n3", "")  # an agent whose server sends no id
        assert [e.shard_id for e in unknown] == ["r3-0"]
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, 9)
            proc.wait()


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat.session == session and stat.state not in "ZX":
            members.append(int(entry.name))
    return members
