"""The KV event socket folders: the agent's user's alone, or refused."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from llmgw.agent.errors import SocketFolderError
from llmgw.agent.ipcdir import check_private_dir, private_dir


def test_a_new_folder_is_0700(tmp_path: Path) -> None:
    folder = private_dir(tmp_path / "a" / "kv")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_our_folder_others_may_only_read_is_tightened(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)  # as agents before the check made STATE_DIR/kv
    private_dir(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_folder_others_may_write_to_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(SocketFolderError, match="has mode 0777"):
        private_dir(folder)


def test_a_symlink_is_refused_even_to_a_private_folder(tmp_path: Path) -> None:
    real = private_dir(tmp_path / "real")
    (tmp_path / "kv").symlink_to(real)
    with pytest.raises(SocketFolderError, match="is a symbolic link"):
        private_dir(tmp_path / "kv")
    with pytest.raises(SocketFolderError, match="is a symbolic link"):
        check_private_dir(tmp_path / "kv")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    os.chown(folder, pwd.getpwnam("nobody").pw_uid, -1)
    with pytest.raises(SocketFolderError, match=r"owned by uid \d+, not by this agent's"):
        private_dir(folder)
