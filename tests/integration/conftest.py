"""Fixtures for the integration suite: real processes on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Cluster

from llmgw.agent.process import is_running
from llmgw.agent.records import RecordStore


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)  # its engine ports: a free window of its own (procs.py)
    try:
        yield c
    finally:
        c.stop_all()
        c.release_engine_ports()


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster; afterwards its agents are stopped and every engine they left is killed."""
    try:
        yield cluster
    finally:
        _stop_with_engines(cluster)


@pytest.fixture
def other_fleet(tmp_path: Path) -> Iterator[Cluster]:
    """A second fleet beside ``fleet`` (under ``tmp_path/other``), with its own engine ports
    and the same cleanup."""
    (tmp_path / "other").mkdir()
    c = Cluster(tmp_path / "other")
    try:
        yield c
    finally:
        _stop_with_engines(c)
        c.release_engine_ports()


def _stop_with_engines(cluster: Cluster) -> None:
    cluster.stop_all()
    for records in cluster.root.glob("*/engines"):
        found, _ = RecordStore(records).load_all()
        for record in found:
            if is_running(record.identity):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record.identity.pid, signal.SIGKILL)
