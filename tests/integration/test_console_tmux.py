"""`llmgw demo` in a real terminal (tmux), driven as a person would drive it.

The demo starts the whole system and opens the console on the terminal; the test types keys
with ``tmux send-keys`` and reads the screen with ``tmux capture-pane``, asserting only what
a person looking at the terminal would see: the LIVE badge, the nodes of the demo, the
replica rows, the id copied from the row the arrows selected, the pause, the help; then
``q`` closes the console and the demo prints its summary and stops everything it started.

Needs tmux (``.ci/run`` installs it). Without it the test is skipped, except under CI
(``CI`` set), where a missing tmux is a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.agent.process import is_running
from llmgw.agent.records import RecordStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WIDTH, HEIGHT = 120, 40
STARTUP_S = 120.0  # three nodes, four engines, a loaded two-core machine (the demo gives up at 90)
KEY_S = 10.0  # a key's effect on the screen


# Sizes inherited from wherever the test runs would override the pane's own (the console
# reads COLUMNS and LINES first); so would an outer tmux's TMUX.
_TERMINAL_ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}


class Terminal:
    """One tmux session on a private server: keys in, the screen's text out."""

    def __init__(self, tmux: str, name: str) -> None:
        self.tmux = tmux
        self.socket = name  # -L: a server of our own, apart from any the user runs

    def run(self, *args: str, check: bool = True) -> str:
        out = subprocess.run(
            [self.tmux, "-L", self.socket, "-f", "/dev/null", *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=check,
            env=_TERMINAL_ENV,
        )
        return out.stdout

    def start(self, command: str) -> None:
        self.run("new-session", "-d", "-s", "t", "-x", str(WIDTH), "-y", str(HEIGHT), command)

    def keys(self, *keys: str) -> None:
        """Keys as tmux names them (``Enter``, ``Down``, ``Space``, ``Escape``) or text."""
        for key in keys:
            self.run("send-keys", "-t", "t", key)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "t", check=False)

    def wait_for(self, *texts: str, seconds: float = KEY_S) -> str:
        """The screen once it shows every one of ``texts``; fails with the screen if not."""
        return self.wait_until(lambda screen: all(t in screen for t in texts), texts, seconds)

    def wait_until(self, check: Callable[[str], bool], what: object, seconds: float = KEY_S) -> str:
        deadline = time.monotonic() + seconds
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if check(screen):
                return screen
            if "DEMO-EXIT=" in screen:  # the demo ended: nothing more will change
                break
            time.sleep(0.2)
        raise AssertionError(f"still not {what}; the screen:\n{screen}")

    def own_pids(self) -> set[int]:
        """tmux's server and the pane's shell: their command lines name what they run."""
        out = self.run("list-panes", "-t", "t", "-F", "#{pid} #{pane_pid}", check=False)
        return {int(word) for word in out.split() if word.isdigit()}

    def close(self) -> None:
        """Stop the server and remove its socket (tmux leaves it behind)."""
        socket = self.run("display-message", "-p", "#{socket_path}", check=False).strip()
        self.run("kill-server", check=False)
        if socket:
            Path(socket).unlink(missing_ok=True)


def _tmux() -> str:
    found = shutil.which("tmux")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("tmux is not installed; .ci/run installs it (apt-get install tmux)")
        pytest.skip("tmux is not installed (apt-get install tmux); .ci/run installs it in CI")
    return found


def _line(screen: str, text: str) -> str:
    return next((line for line in screen.splitlines() if text in line), "")


_REPLICA_ROW = re.compile(r"^\s*((chat|small|tiny)-\d+)\s+● READY\s+(\w+)\s")


def _replica_rows(screen: str) -> list[tuple[str, str]] | None:
    """The replicas view's rows, (id, model) in screen order, once all four are READY."""
    if "REPLICA" not in screen:
        return None
    rows = []
    for line in screen.splitlines():
        if found := _REPLICA_ROW.match(line):
            replica, prefix, model = found.groups()
            if prefix != model:
                return None
            rows.append((replica, model))
    return rows if len(rows) == 4 else None


def _processes_mentioning(text: str, *, besides: set[int]) -> dict[int, str]:
    """Live processes whose command line holds ``text`` (but this one and ``besides``)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in {os.getpid(), *besides}:
            with contextlib.suppress(OSError):
                cmdline = (entry / "cmdline").read_bytes()
                if text.encode() in cmdline and _alive(entry):
                    found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode()
    return found


def _alive(proc: Path) -> bool:
    """Not a zombie: a child the tmux shell has not reaped yet is gone in all but name."""
    return (proc / "stat").read_text().rpartition(")")[2].split()[0] not in "ZX"


def _engines_running(state: Path) -> list[str]:
    running = []
    for records in state.glob("*/engines"):
        found, _ = RecordStore(records).load_all()
        running += [r.shard_id for r in found if is_running(r.identity)]
    return running


@contextlib.contextmanager
def _demo_in_tmux(tmux: str, state: Path) -> Iterator[Terminal]:
    """The demo running in a tmux pane; afterwards nothing of it is left, whatever failed."""
    term = Terminal(tmux, f"llmgw-test-{os.getpid()}")
    demo = f"{sys.executable} -m llmgw demo --rate 4 --state-dir {state}"
    term.start(f"unset COLUMNS LINES; cd {Path.cwd()} && {demo}; echo DEMO-EXIT=$?; sleep 600")
    tmux_pids = term.own_pids()
    try:
        yield term
    finally:
        if "DEMO-EXIT=" not in term.screen():  # a failure before q: stop it as Ctrl-C would
            for pid in _processes_mentioning(demo, besides=tmux_pids):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(AssertionError):
                term.wait_for("DEMO-EXIT=", seconds=30)
        term.close()
        for pid in _processes_mentioning(str(state), besides=tmux_pids):  # a leak fails the
            with contextlib.suppress(ProcessLookupError):  # test, but never outlives it
                os.kill(pid, signal.SIGKILL)


def test_a_person_drives_the_demo_console_in_a_terminal(tmp_path: Path) -> None:
    tmux = _tmux()
    state = tmp_path / "demo"
    with _demo_in_tmux(tmux, state) as term:
        screen = term.wait_for("LIVE", "3/3 ready", "READY 4", seconds=STARTUP_S)
        assert "overview" in _line(screen, "LIVE")  # the view names and the badge, on top

        term.keys(":nodes", "Enter")
        screen = term.wait_for("NODE", "8×H100", "└3g.40gb")
        for node, word in (("dgx-1", "● READY"), ("mig-1", "● READY"), ("l4-1", "● READY")):
            assert word in _line(screen, f" {node} "), screen  # the node's own row comes first

        term.keys(":replicas", "Enter")
        screen = term.wait_until(lambda screen: _replica_rows(screen) is not None, "the replicas")
        rows = _replica_rows(screen)
        assert rows is not None
        # Ids are the server's: a replica refused its port (another process on the machine
        # holds it) is replaced under the next number, so the test reads them off the screen.
        assert [model for _, model in rows] == ["chat", "chat", "small", "tiny"], screen

        term.keys("Down", "Down", "c")  # the third row, by id: the small one
        term.wait_for(f"copied {rows[2][0]}")

        term.keys("Space")
        term.wait_for("LIVE · PAUSED")
        term.keys("Space")
        term.wait_until(lambda screen: "PAUSED" not in _line(screen, "LIVE"), "resumed")

        term.keys("?")
        screen = term.wait_for("Keys: Replicas", "drain", "pause", "copy id")
        term.keys("Escape")  # as a person does: looks for the help to go before typing on
        term.wait_until(lambda screen: "Keys: Replicas" not in screen, "the help closed")

        term.keys("q")
        screen = term.wait_for("llmgw demo: summary", "DEMO-EXIT=0", seconds=60)
        assert "replicas READY     4/4" in screen
        answered = re.search(r"(\d+) ok, 0 failed", screen)  # the workload went through
        assert answered is not None and int(answered.group(1)) > 0, screen
        assert _processes_mentioning(str(state), besides=term.own_pids()) == {}
        assert _engines_running(state) == []
