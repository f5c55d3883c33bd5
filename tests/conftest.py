"""Fixtures shared by every test directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tlspki import Pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA, a loopback server certificate it signed, and wrong files (tests/tlspki.py)."""
    from tlspki import make_pki  # imports cryptography: only where a test asks for a PKI

    return make_pki(tmp_path / "pki")
