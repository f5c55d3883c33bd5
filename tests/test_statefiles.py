"""llmgw.statefiles: owner-only state directories and files, tightened when found looser."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from llmgw.statefiles import owner_only_umask, private_dir, private_files, private_tree, sidecars


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_new_directory_and_its_new_parents_are_0700(tmp_path: Path) -> None:
    private_dir(tmp_path / "a" / "b")
    assert (_mode(tmp_path / "a"), _mode(tmp_path / "a" / "b")) == (0o700, 0o700)


def test_a_looser_directory_is_tightened_and_said_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    with caplog.at_level(logging.WARNING, "llmgw.statefiles"):
        private_dir(state)
    assert _mode(state) == 0o700
    assert f"{state} was readable by others (mode 0755): tightened to 0700" in caplog.text


def test_a_shared_sticky_directory_is_left_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: never made private under the feet of other users
    with caplog.at_level(logging.WARNING, "llmgw.statefiles"):
        private_dir(shared)
    assert _mode(shared) == 0o1777
    assert "is a shared directory (mode 1777): left as it is" in caplog.text


def test_a_tree_is_tightened_without_following_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("not ours to change")
    outside.chmod(0o644)
    root = tmp_path / "agent"
    (root / "engines").mkdir(parents=True)
    (root / "engines").chmod(0o755)
    (root / "engines" / "r1.key").write_text("sk")
    (root / "engines" / "r1.key").chmod(0o644)
    (root / "link").symlink_to(outside)
    private_tree(root)
    assert _mode(root / "engines") == 0o700
    assert _mode(root / "engines" / "r1.key") == 0o600
    assert _mode(outside) == 0o644


def test_sidecars_are_the_files_named_after_the_database(tmp_path: Path) -> None:
    for name in ("server.db", "server.db-wal", "server.db-shm", "server.db.lock", "other.db"):
        (tmp_path / name).touch()
    assert [p.name for p in sidecars(tmp_path / "server.db")] == [
        "server.db",
        "server.db-shm",
        "server.db-wal",
        "server.db.lock",
    ]


def test_the_umask_makes_new_files_owner_only_and_is_restored(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        with owner_only_umask():
            (tmp_path / "made").touch()
        (tmp_path / "after").touch()
    finally:
        os.umask(before)
    assert (_mode(tmp_path / "made"), _mode(tmp_path / "after")) == (0o600, 0o644)


def test_a_mode_that_cannot_be_changed_is_said_and_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "server.db"
    db.touch()
    db.chmod(0o644)

    def read_only(path: object, mode: int) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "chmod", read_only)
    with caplog.at_level(logging.WARNING, "llmgw.statefiles"):
        private_files([db])
    assert f"{db} is readable by others (mode 0644) and stays so" in caplog.text
