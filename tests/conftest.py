"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from pgcluster import db, pg_cluster, pg_url  # noqa: F401  (fixtures for every directory)

if TYPE_CHECKING:
    from tlspki import Pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA, a loopback server certificate it signed, and wrong files (tests/tlspki.py)."""
    from tlspki import make_pki  # imports cryptography: only where a test asks for a PKI

    return make_pki(tmp_path / "pki")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (its hook suffixes node ids)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the real-vLLM tests on one xdist worker, one after another.

    Each starts a CPU vLLM that wants every core for minutes; two at once on CI's two
    cores would starve both past their timeouts. Everything else spreads (`--dist
    loadgroup` in `.ci/run`): the suite mostly waits on processes it started.
    """
    for item in items:
        if item.get_closest_marker("real_vllm"):
            item.add_marker(pytest.mark.xdist_group("real_vllm"))
