"""The folders that hold an engine's ``ipc://`` KV event sockets, private to the agent's user.

Whoever can put a socket where the agent connects feeds the agent's block mirrors (and so
steers routing), so every socket folder must be the agent's alone: owned by the agent's
user, a real directory (not a symlink), with no group or other access. `private_dir`
creates one that way (or checks one that exists), and `check_private_dir` is what the KV
event subscriber runs before it connects.

The sockets live in ``STATE_DIR/kv`` unless a path there is too long for a Unix socket
(107 bytes). Then they live in a folder under ``/tmp`` with a random name, made like
``tempfile.mkdtemp`` (mode 0700, created exclusively, so nobody can have made it first),
whose path is kept in ``STATE_DIR/kv-ipc-dir``: a restarted agent uses the same folder and
finds its running engines' sockets again. A predictable name would let another local user
create the folder, and the sockets in it, before the agent does.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

from llmgw.agent.errors import SocketFolderError

__all__ = ["SHORT_IPC_ROOT", "check_private_dir", "private_dir", "short_ipc_dir"]

log = logging.getLogger(__name__)

SHORT_IPC_ROOT = Path("/tmp")  # not $TMPDIR: that may be as long as the state dir
SHORT_IPC_PREFIX = "llmgw-kv-"
_REMEMBERED = "kv-ipc-dir"  # in the state dir: the short folder's path


def check_private_dir(path: Path) -> None:
    """Raise SocketFolderError unless ``path`` is a directory (not a symlink) owned by this
    process's user with no group or other permission bits."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise SocketFolderError(f"KV event socket folder {path}: {exc.strerror}") from exc
    problem = _problem(info)
    if problem:
        raise SocketFolderError(
            f"KV event socket folder {path} {problem}; refusing to use it "
            "(another user could feed the agent false KV events): remove it"
        )


def _problem(info: os.stat_result) -> str:
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this agent's uid {os.geteuid()}"
    if info.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(info.st_mode):04o} (group or others may use it)"
    return ""


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700, parents as needed) or check the one there.

    A folder of ours that others may only read or enter (0755, as agents before this check
    made ``STATE_DIR/kv``) is tightened to 0700; one others may write to, or owned by
    someone else, or a symlink, is refused (`check_private_dir`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        info = os.lstat(path)
        mode = stat.S_IMODE(info.st_mode)
        writable_by_others = mode & 0o022
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not writable_by_others:
            if mode & 0o077:
                log.info("KV event socket folder %s: mode %04o tightened to 0700", path, mode)
                os.chmod(path, 0o700, follow_symlinks=False)
    check_private_dir(path)
    return path


def short_ipc_dir(state_dir: Path) -> Path:
    """This agent's short socket folder: the one ``STATE_DIR/kv-ipc-dir`` names when it is
    still there, else a new one with a random name under `SHORT_IPC_ROOT` (remembered)."""
    remembered = state_dir / _REMEMBERED
    try:
        folder = Path(remembered.read_text(encoding="utf-8").strip())
    except FileNotFoundError:
        folder = None
    if folder is not None and os.path.lexists(folder):
        if folder.parent != SHORT_IPC_ROOT or not folder.name.startswith(SHORT_IPC_PREFIX):
            raise SocketFolderError(
                f"{remembered} names {folder}, not a folder under {SHORT_IPC_ROOT}"
            )
        check_private_dir(folder)
        return folder
    state_dir.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=SHORT_IPC_PREFIX, dir=SHORT_IPC_ROOT))
    partial = remembered.with_suffix(".tmp")
    partial.write_text(f"{folder}\n", encoding="utf-8")
    os.replace(partial, remembered)
    log.info("KV event sockets of this agent live in %s (the state dir is too long)", folder)
    return folder
