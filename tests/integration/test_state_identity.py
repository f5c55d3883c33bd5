"""The state database's identity, from outside: ``llmgw server`` processes on one file.

A second server on a ``--db`` that one already serves refuses at once, naming the first
(which keeps serving, and ``llmgw token`` keeps writing the file beside it); a 0-byte file,
a PNG and an SQLite database of another program are refused with what they are and left
byte for byte as they were; a replica row that cannot be read stops the start, naming it,
instead of being dropped (its port and GPUs given to another while its engines run).
"""

from __future__ import annotations

import hashlib
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import Cluster

from llmgw.addresses import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + b"\0" * 64


def server(db: Path, *extra: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``llmgw server --db DB`` on fresh ports, expected to stop by itself."""
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "server", "--db", str(db)]
        + ["--grpc-listen", f"127.0.0.1:{free_port()}", "--http-listen", f"127.0.0.1:{free_port()}"]
        + ["--gateway-listen", "off", *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def fingerprint(path: Path) -> tuple[int, str, list[str]]:
    """Size, SHA-256 and the names beside it but the server's lock: what must not change."""
    data = path.read_bytes()
    beside = sorted(p.name for p in path.parent.iterdir() if p.name != f"{path.name}.lock")
    return len(data), hashlib.sha256(data).hexdigest(), beside


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_second_server_on_the_same_db_refuses_naming_the_first(cluster: Cluster) -> None:
    first = cluster.start_server()
    db = cluster.root / "server.db"
    grpc, http = free_port(), free_port()
    started = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "llmgw", "server", "--db", str(db), "--gateway-listen", "off"]
        + ["--grpc-listen", f"127.0.0.1:{grpc}", "--http-listen", f"127.0.0.1:{http}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert time.monotonic() - started < 15  # at once, not after serving
    message = second.stderr.strip().splitlines()
    assert len(message) == 1, second.stderr
    assert (
        f"is in use by llmgw server pid {first.pid} on host {socket.gethostname()}" in (message[0])
    )
    assert str(db) in message[0] and " since " in message[0]
    assert "Traceback" not in second.stderr
    assert not listening(grpc) and not listening(http)
    # the first keeps serving, and tokens are still written beside it
    assert cluster.healthy()
    assert first.poll() is None
    assert cluster.create_token("admin", "while serving")
    listed = subprocess.run(
        [sys.executable, "-m", "llmgw", "token", "list", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "while serving" in listed.stdout


def test_the_lock_goes_with_the_server(cluster: Cluster) -> None:
    cluster.start_server()
    cluster.kill("server")  # SIGKILL: no clean-up ran; the kernel let go of the lock
    cluster.start_server()
    assert cluster.healthy()


def test_an_empty_db_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    db = tmp_path / "server.db"
    db.touch()
    before = fingerprint(db)
    out = server(db)
    assert out.returncode != 0
    assert f"{db} is empty: not an llmgw state database" in out.stderr
    assert "Traceback" not in out.stderr
    assert fingerprint(db) == before


@pytest.mark.parametrize("kind", ["png", "sqlite-of-another-program", "sqlite-without-tables"])
def test_a_foreign_db_file_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    db = tmp_path / "server.db"
    if kind == "png":
        db.write_bytes(PNG)
        said = "not an SQLite file"
    else:
        with sqlite3.connect(db) as conn:
            if kind == "sqlite-of-another-program":
                conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
                conn.execute("INSERT INTO photos (path) VALUES ('/home/me/cat.jpg')")
                said = "it holds the tables photos"
            else:
                conn.execute("PRAGMA user_version = 0")
                said = "it holds no tables"
        conn.close()
    before = fingerprint(db)
    out = server(db)
    assert out.returncode != 0
    assert f"{db} is not an llmgw state database" in out.stderr
    assert said in out.stderr
    assert fingerprint(db) == before
    # the token CLI refuses it the same way
    token = subprocess.run(
        [sys.executable, "-m", "llmgw", "token", "list", "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert token.returncode != 0 and "is not an llmgw state database" in token.stderr
    assert fingerprint(db) == before


def test_a_missing_db_is_created_with_a_cluster_id(cluster: Cluster) -> None:
    db = cluster.root / "server.db"
    assert not db.exists()
    cluster.start_server()
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (cluster_id,) = conn.execute(
            "SELECT value FROM llmgw_meta WHERE key = 'cluster_id'"
        ).fetchone()
    conn.close()
    assert len(cluster_id) == 32
    assert not [p for p in db.parent.iterdir() if ".new-" in p.name]  # no temporary left


def test_an_unreadable_replica_row_stops_the_start_naming_it(cluster: Cluster) -> None:
    cluster.start_server()
    cluster.kill("server", 15)
    db = cluster.root / "server.db"
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO replicas (replica_id, record, updated) VALUES (?, ?, ?)",
            ("chat-7f3a", '{"replica_id": "chat-7f3a", "shards": [', 0),
        )
    conn.close()
    before = fingerprint(db)
    out = server(db)
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert "table replicas, row 'chat-7f3a' cannot be read" in line
    assert "the server does not start without it" in line
    assert fingerprint(db)[:2] == before[:2]


def test_a_token_row_of_an_unknown_role_stops_the_start_naming_it(cluster: Cluster) -> None:
    db = cluster.root / "server.db"
    cluster.create_token("admin")
    with sqlite3.connect(db) as conn:  # the only token, now of a role nobody knows
        conn.execute("UPDATE tokens SET role = 'superuser'")
    conn.close()
    out = server(db)
    assert out.returncode != 0  # skipped, it would leave no token: authentication off
    assert "table tokens, row '1' cannot be read" in out.stderr.strip().splitlines()[-1]
