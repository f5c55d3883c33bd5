"""The agent's engine log files: rotation, the previous run, pruning, tails and following."""

from __future__ import annotations

import os
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.enginelog import EngineLog
from llmgw.agent.logfiles import LogFiles, LogFollower, prune, shard_of, tail_lines

# --- layout, rotation and the previous run -----------------------------------------------


def test_a_restart_keeps_the_run_before_and_drops_its_rotated_part(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "r-1.0")
    files.start_run()  # nothing yet: nothing moves
    assert not files.previous.exists()
    files.current.write_text("run 1, late\n")
    files.rotated.write_text("run 1, early\n")
    files.start_run()
    assert files.previous.read_text() == "run 1, late\n"
    assert not files.current.exists() and not files.rotated.exists()
    files.current.write_bytes(b"")
    files.start_run()  # an empty run (an engine that never wrote) replaces nothing
    assert files.previous.read_text() == "run 1, late\n"
    assert files.run(previous=True) == [files.previous]


def test_rotation_copies_and_empties_in_place_so_the_engine_goes_on(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "s")
    fd = os.open(files.current, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"one\ntwo\n")
        files.rotate()
        os.write(fd, b"three\n")  # the engine's descriptor, unchanged
    finally:
        os.close(fd)
    assert files.rotated.read_bytes() == b"one\ntwo\n"
    assert files.current.read_bytes() == b"three\n"
    assert files.rotated.stat().st_mode & 0o777 == 0o600
    assert files.run() == [files.rotated, files.current]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.log", "s.log.1"]


def test_an_engine_log_stays_within_its_bound_while_the_engine_writes(tmp_path: Path) -> None:
    log = EngineLog(tmp_path / "s.log", max_file_bytes=1000)
    fd = log.open_for_engine("start")
    try:
        for n in range(500):
            os.write(fd, b"line %04d of some engine output\n" % n)
            if n % 10 == 0:
                log.refresh()
        log.refresh()
    finally:
        os.close(fd)
    files = LogFiles(tmp_path, "s")
    assert files.current.stat().st_size <= 1000 + 11 * 32  # one refresh's worth over at most
    assert files.rotated.stat().st_size <= 1000 + 11 * 32
    assert log.tail(1) == ["line 0499 of some engine output"]


# --- pruning -------------------------------------------------------------------------------


def test_prune_removes_only_old_logs_of_shards_not_running(tmp_path: Path) -> None:
    now = time.time()
    names = ["gone.log", "gone.log.1", "gone.previous.log", "fresh.log", "live.log", "notes.txt"]
    for name in names:
        (tmp_path / name).write_text("x\n")
    old = now - 25 * 3600
    for name in ("gone.log", "gone.log.1", "gone.previous.log", "live.log", "notes.txt"):
        os.utime(tmp_path / name, (old, old))
    removed = prune(tmp_path, keep={"live"}, retention_s=24 * 3600, now=now)
    assert sorted(p.name for p in removed) == ["gone.log", "gone.log.1", "gone.previous.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.log", "live.log", "notes.txt"]
    assert prune(tmp_path / "missing", keep=set(), retention_s=1) == []


def test_shard_names_from_file_names() -> None:
    assert shard_of("chat-1.0.log") == "chat-1.0"
    assert shard_of("chat-1.0.log.1") == "chat-1.0"
    assert shard_of("chat-1.0.previous.log") == "chat-1.0"
    assert shard_of(".chat-1.0.log.1.partial") is None
    assert shard_of(".log") is None and shard_of("node-id") is None


# --- reading -------------------------------------------------------------------------------


@given(
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    st.integers(0, 80),
    st.integers(0, 40),
    st.booleans(),
)
def test_tail_lines_is_the_end_of_every_line(
    lines: list[bytes], split: int, count: int, ended: bool
) -> None:
    """However the text is split between the rotated file and the current one."""
    import tempfile

    text = b"\n".join(lines) + (b"\n" if ended and lines else b"")
    cut = min(split, len(text))
    with tempfile.TemporaryDirectory() as folder:
        first, second = Path(folder) / "a", Path(folder) / "b"
        first.write_bytes(text[:cut])
        second.write_bytes(text[cut:] + b"written later")
        files = [(first, cut), (second, len(text) - cut)]
        every = tail_lines(files, None)
        expected = text.split(b"\n")
        if expected and expected[-1] == b"":
            expected.pop()
        assert every == expected
        assert tail_lines(files, count) == (expected[-count:] if count else [])


def test_the_follower_reads_across_a_rotation_and_a_restart(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "s")
    files.current.write_bytes(b"before\n")
    follower = LogFollower(files)
    assert follower.offset == 7 and follower.read(100) == b""
    with files.current.open("ab") as out:
        out.write(b"one\ntwo\n")
    assert follower.read(4) == b"one\n"
    with files.current.open("ab") as out:
        out.write(b"three\n")
    files.rotate()  # what was not read yet is in the rotated copy
    with files.current.open("ab") as out:
        out.write(b"four\n")
    assert follower.read(3) + follower.read(100) + follower.read(100) == b"two\nthree\nfour\n"
    with files.current.open("ab") as out:
        out.write(b"five\n")
    files.start_run()  # a restart: the file becomes the previous run's
    files.current.write_bytes(b"=== new run\n")
    assert follower.read(100) == b"five\n"
    assert follower.read(100) == b"=== new run\n"
    follower.close()


def test_a_follower_waits_for_a_log_that_does_not_exist_yet(tmp_path: Path) -> None:
    files = LogFiles(tmp_path, "s")
    follower = LogFollower(files)
    assert follower.read(10) == b""
    files.current.write_bytes(b"hello\n")
    assert follower.read(10) == b"hello\n"
    follower.close()
