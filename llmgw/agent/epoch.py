"""The newest leader epoch this agent has seen, remembered in its state directory (fencing).

Several control servers may share one database (issue #17); one leads, under a lease whose
epoch only grows, and every message of its agent streams carries that epoch
(``ControlMessage.leader_epoch``). A server that lost the lease but has not noticed yet (a
deposed leader) still sends the old epoch; the agent must not obey it. So the agent keeps
the newest epoch it has seen in ``STATE_DIR/leader-epoch`` and refuses every message of an
older one: `LeaderEpoch.admit` says False, logs both epochs, and counts it in ``refused``.
A newer epoch is written before ``admit`` returns True, atomically (a new file renamed over
the old one) and durably (the file and its directory are synced), so a command of that
epoch is carried out only once a restarted agent would still remember it. Epoch 0 (a
server from before issue #17) is admitted only while the remembered epoch is 0.

Epochs compare within one cluster (one database's lease): the file holds the epoch and the
cluster id it belongs to (``EPOCH CLUSTER_ID``; a bare ``EPOCH`` of an older agent is of
no cluster in particular). A message of another cluster is compared with nothing and its
epoch replaces the remembered one: a new database starts at epoch 1 again, and which
cluster may command the engines at all is ``llmgw.agent.cluster``'s to decide.

A file that cannot be read or does not hold a decimal epoch is an `EpochFileError` (the
agent stops with it at start-up, naming the file): reading it as 0 would let a deposed
leader command the engines again. Removing the file (with the agent stopped) forgets it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from llmgw.statefiles import owner_only_umask

log = logging.getLogger(__name__)

LEADER_EPOCH_FILE = "leader-epoch"
_MAX_DIGITS = 20  # a uint64 has at most 20 decimal digits


def _cluster_ok(text: str) -> bool:
    return len(text) <= 64 and all(c.isalnum() or c in "-_" for c in text)


class EpochFileError(ValueError):
    """The remembered leader epoch cannot be read or is malformed; the message names the file."""


class LeaderEpoch:
    """The newest leader epoch seen, and how many messages of an older one were refused."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / LEADER_EPOCH_FILE
        self.remembered, self.cluster = self._read()
        self.refused = 0  # messages refused for an older epoch, since this process started

    def admit(self, epoch: int, *, what: str, server: str, cluster: str = "") -> bool:
        """Whether a message (``what``, from ``server`` of ``cluster``) of leader epoch
        ``epoch`` may be carried out; a newer epoch is remembered durably first."""
        if cluster and self.cluster and cluster != self.cluster:
            log.info(
                "leader epoch %d of cluster %s replaces epoch %d of cluster %s",
                epoch, cluster, self.remembered, self.cluster,
            )  # fmt: skip
            self._remember(epoch, cluster)
            return True
        if epoch < self.remembered:
            self.refused += 1
            log.warning(
                "%s from %s refused: its leader epoch %d is older than epoch %d, the newest "
                "this agent has seen (a deposed leader); %d message(s) refused so far",
                what,
                server,
                epoch,
                self.remembered,
                self.refused,
            )
            return False
        if epoch > self.remembered:
            log.info("leader epoch %d (was %d), from %s", epoch, self.remembered, server)
            self._remember(epoch, cluster or self.cluster)
        elif cluster and not self.cluster:
            self._remember(epoch, cluster)
        return True

    def _read(self) -> tuple[int, str]:
        try:
            text = self._path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0, ""
        except (OSError, UnicodeDecodeError) as exc:
            raise EpochFileError(f"{self._path}: cannot read the leader epoch ({exc})") from exc
        number, _, cluster = text.partition(" ")
        if not (number.isdigit() and len(number) <= _MAX_DIGITS) or not _cluster_ok(cluster):
            raise EpochFileError(
                f"{self._path}: {text[:64]!r} is not a leader epoch (a decimal number and "
                "a cluster id); remove the file only if no deposed control server can reach "
                "this agent"
            )
        return int(number), cluster

    def _remember(self, epoch: int, cluster: str) -> None:
        """Write ``epoch`` of ``cluster`` durably: a new owner-only file renamed over the old."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        temp = self._path.with_name(f".{LEADER_EPOCH_FILE}.{os.getpid()}")
        with owner_only_umask(), temp.open("w", encoding="ascii") as file:
            file.write(f"{epoch} {cluster}".rstrip() + "\n")
            file.flush()
            os.fsync(file.fileno())
        temp.replace(self._path)
        directory = os.open(self._path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        self.remembered, self.cluster = epoch, cluster
