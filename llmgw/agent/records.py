"""What the agent writes down about each engine, so that a restarted agent adopts it.

One JSON file per engine, ``STATE_DIR/engines/SHARD.json``, written (atomically) after
each spawn and removed when the shard is stopped on purpose::

    {"version": 1, "shard_id": "r1-0", "pid": 4242, "start_ticks": 1234567,
     "boot_id": "…", "fingerprint": "…", "port": 8100, "engine": "vllm",
     "api_key_file": "r1-0.key", "restarts": 0, "started_unix_ms": …,
     "log_path": "…/logs/r1-0.log", "stopping": false,
     "start": {…StartShard as proto3 JSON, api key blank…}}

The engine's API key is kept apart in ``SHARD.key`` (mode 0600); the record refers to it.
A restarted agent adopts an engine when its pid is alive with the same start time and
boot id and the record's command fingerprint equals the one it would launch now. A record
marked ``stopping`` (the agent died during a stop or a drain) is never adopted: the next
agent finishes the stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.agent.errors import RecordError
from llmgw.agent.process import ProcessIdentity
from llmgw.api.llmgw.v1 import StartShard

log = logging.getLogger(__name__)

RECORD_VERSION = 1
SHARD_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True, slots=True)
class EngineRecord:
    """One running engine as the agent that started it saw it."""

    shard_id: str
    identity: ProcessIdentity
    fingerprint: str
    port: int
    engine: str
    start: StartShard  # as the server sent it, with its API key
    restarts: int
    started_unix_ms: int
    log_path: str
    stopping: bool = False  # a stop or drain began: the next agent finishes it, never restarts

    def to_json(self, key_file: str) -> dict[str, Any]:
        start = StartShard.from_dict(self.start.to_dict())
        start.api_key = ""
        return {
            "version": RECORD_VERSION,
            "shard_id": self.shard_id,
            "pid": self.identity.pid,
            "start_ticks": self.identity.start_ticks,
            "boot_id": self.identity.boot_id,
            "fingerprint": self.fingerprint,
            "port": self.port,
            "engine": self.engine,
            "api_key_file": key_file,
            "restarts": self.restarts,
            "started_unix_ms": self.started_unix_ms,
            "log_path": self.log_path,
            "stopping": self.stopping,
            "start": start.to_dict(),
        }


class RecordStore:
    """The engine records of one agent state directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, shard_id: str) -> Path:
        return self.directory / f"{_checked(shard_id)}.json"

    def save(self, record: EngineRecord) -> None:
        """Write ``record`` (and its key file) atomically."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key_file = f"{_checked(record.shard_id)}.key"
        _write_atomic(self.directory / key_file, record.start.api_key.encode(), mode=0o600)
        body = json.dumps(record.to_json(key_file), indent=2, sort_keys=True).encode()
        _write_atomic(self.path(record.shard_id), body + b"\n", mode=0o600)

    def delete(self, shard_id: str) -> None:
        for suffix in (".json", ".key"):
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{_checked(shard_id)}{suffix}").unlink()

    def load_all(self) -> tuple[list[EngineRecord], list[tuple[Path, RecordError]]]:
        """Every readable record, and the path and error of each file that is not one."""
        records: list[EngineRecord] = []
        errors: list[tuple[Path, RecordError]] = []
        if not self.directory.is_dir():
            return records, errors
        for path in sorted(self.directory.glob("*.json")):
            try:
                records.append(self.load(path))
            except RecordError as exc:
                errors.append((path, exc))
        return records, errors

    def load(self, path: Path) -> EngineRecord:
        """The record in ``path``; RecordError naming the file and the fault."""
        try:
            data = json.loads(path.read_text())
            record = _from_json(data, self.directory)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"engine record {path}: {exc}") from exc
        if path.stem != record.shard_id:
            raise RecordError(f"engine record {path}: holds shard {record.shard_id!r}")
        return record

    def discard(self, path: Path) -> None:
        """Remove an unreadable record file (and the key beside it)."""
        for target in (path, path.with_suffix(".key")):
            with contextlib.suppress(FileNotFoundError):
                target.unlink()


def _from_json(data: Any, directory: Path) -> EngineRecord:
    if not isinstance(data, dict):
        raise ValueError(f"a JSON object was expected, not {type(data).__name__}")
    if data.get("version") != RECORD_VERSION:
        raise ValueError(f"version {data.get('version')!r}, this agent reads {RECORD_VERSION}")
    start = StartShard.from_dict(data["start"])
    start.api_key = (directory / Path(str(data["api_key_file"])).name).read_text()
    return EngineRecord(
        shard_id=_checked(str(data["shard_id"])),
        identity=ProcessIdentity(
            pid=int(data["pid"]), start_ticks=int(data["start_ticks"]), boot_id=data["boot_id"]
        ),
        fingerprint=str(data["fingerprint"]),
        port=int(data["port"]),
        engine=str(data["engine"]),
        start=start,
        restarts=int(data["restarts"]),
        started_unix_ms=int(data["started_unix_ms"]),
        log_path=str(data["log_path"]),
        stopping=bool(data.get("stopping", False)),
    )


def _checked(shard_id: str) -> str:
    if not SHARD_ID.match(shard_id):
        raise ValueError(f"shard id {shard_id!r} is not valid (letters, digits, '.', '_', '-')")
    return shard_id


def _write_atomic(path: Path, data: bytes, *, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
