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
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop_all()


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster; afterwards its agents are stopped and every engine they left is killed."""
    try:
        yield cluster
    finally:
        cluster.stop_all()
        for records in cluster.root.glob("*/engines"):
            found, _ = RecordStore(records).load_all()
            for record in found:
                if is_running(record.identity):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(record.identity.pid, signal.SIGKILL)
