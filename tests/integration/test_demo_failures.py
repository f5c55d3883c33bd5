"""The demo when something goes wrong, and from a working directory that holds a ``llmgw``
folder (a clone in ``~``): real processes, as a user runs them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.cli.demo import NODES_READY_S, state_dir
from llmgw.cli.errors import CliError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    """Kill what a demo that did not stop left (its children have sessions of their own, so
    a demo killed by a timeout leaves agents that would join other tests' servers)."""
    yield
    for pid in _processes_mentioning(str(tmp_path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(entry.name))
    return found


def _bogus_clone(folder: Path) -> Path:
    """A working directory with a ``llmgw`` package that is not ours."""
    (folder / "llmgw").mkdir(parents=True)
    (folder / "llmgw" / "__init__.py").write_text('"""Not the llmgw you are looking for."""\n')
    return folder


def _demo(state: Path, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    args = ["demo", "--headless", "--duration", "2", "--rate", "2", "--state-dir", str(state)]
    return subprocess.run(
        [sys.executable, "-P", "-m", "llmgw", *args],
        capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
    )  # fmt: skip


def test_a_child_that_exits_ends_the_demo_at_once_naming_it_with_its_log(
    tmp_path: Path,
) -> None:
    state = tmp_path / "demo"
    state.mkdir()
    (state / "server.db").write_bytes(b"not a database " * 100)  # the server cannot start
    started = time.monotonic()
    out = _demo(state, tmp_path, timeout_s=NODES_READY_S + 30)
    took = time.monotonic() - started
    assert out.returncode == 1, out.stdout + out.stderr
    log = state / "logs" / "server.log"
    assert f"llmgw: the server process exited (status 1); the end of {log}:" in out.stderr
    assert "  llmgw: " in out.stderr  # the server's own last line, from its log
    # before the first wait of the demo ran out: it noticed the exit, not the timeout (a
    # loaded CI machine took 33 s to start the demo's three Pythons and the server's failure)
    assert took < NODES_READY_S, f"the demo took {took:.0f}s to notice"
    assert log.exists()


def test_a_failed_demo_keeps_its_temporary_state_and_says_where(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(CliError), state_dir(None, prefix="demo-") as failed:
        (failed / "logs").mkdir()
        raise CliError("the server process exited (status 1)")
    assert (failed / "logs").is_dir()
    assert capsys.readouterr().err == f"llmgw: the state and logs are kept in {failed}\n"
    with state_dir(None, prefix="demo-") as fine:
        pass
    with pytest.raises(CliError), state_dir(None, prefix="demo-") as stopped:
        raise CliError("stopped before the demo was up", exit_code=130)  # Ctrl-C
    assert not fine.exists() and not stopped.exists()


@pytest.mark.timeout(150)
def test_the_demo_runs_from_a_folder_holding_another_llmgw(tmp_path: Path) -> None:
    cwd = _bogus_clone(tmp_path / "home")
    state = tmp_path / "demo"
    out = _demo(state, cwd, timeout_s=130)
    assert out.returncode == 0, out.stdout + out.stderr + _logs(state)
    assert "replicas READY     4/4" in out.stdout


def _logs(state: Path) -> str:
    return "".join(f"\n--- {p}\n{p.read_text()[-2000:]}" for p in (state / "logs").glob("*.log"))
