"""Which cluster this agent's engines belong to, remembered in its state directory.

Every control server's database has a cluster id (``llmgw.server.state.statefile``), sent to
agents in ``Registered.cluster_id``. The agent keeps the id of the cluster it handed its
engines to in ``STATE_DIR/cluster-id`` and sends it in every ``Register``. A server of
another cluster (one started on the wrong ``--db``, or on a new one) knows none of the
agent's engines and would stop them as unknown; so when the ids differ and the agent runs
engines, it does not hand them over: it keeps them running, sends no statuses for them,
carries out no command, and warns naming both ids; that server shows the node NOT_READY
with the engines in ``Node.unadopted_shards``. It stays so, reconnect after reconnect,
until an operator acts: restarting the agent with ``--join-cluster ID`` makes ``ID`` the
remembered cluster, so the server of that cluster adopts the engines it knows and stops
the others (stopping the engines and removing ``cluster-id`` does as well).

An agent that remembers no cluster (a first start, or a state directory from before
cluster ids) takes the server's; so does one that runs no engines (there is nothing to
lose). A server that sends no id (one from before cluster ids) gets the engines as before.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

CLUSTER_ID_FILE = "cluster-id"
CLUSTER_ID_RULE = "32 lowercase hexadecimal digits, as `llmgw get nodes` shows it"
_CLUSTER_ID = re.compile(r"[0-9a-f]{32}")


class ClusterIdError(ValueError):
    """A cluster id (a flag's, or the remembered one) is malformed; the message says where."""


def check_cluster_id(text: str, where: str) -> str:
    """``text`` if it is a cluster id; ClusterIdError naming ``where`` if not."""
    if _CLUSTER_ID.fullmatch(text) is None:
        raise ClusterIdError(f"{where}: {text[:64]!r} is not a cluster id ({CLUSTER_ID_RULE})")
    return text


class ClusterMembership:
    """The remembered cluster id, and whether the engines are handed to the current server.

    ``join`` (``--join-cluster``) replaces the remembered id at once, before any session.
    """

    def __init__(self, state_dir: Path, join: str | None = None) -> None:
        self._path = state_dir / CLUSTER_ID_FILE
        self.remembered = self._read()
        self.holding_for = ""  # the current server's id while the engines are kept from it
        if join is not None and check_cluster_id(join, "--join-cluster") != self.remembered:
            log.warning(
                "joining cluster %s (this agent's engines belonged to %s): its server adopts "
                "the engines it knows and stops the others",
                join,
                self.remembered or "no cluster yet",
            )
            self._remember(join)

    @property
    def holding(self) -> bool:
        """Whether the engines are kept from the server of the current session."""
        return bool(self.holding_for)

    def registered(self, server_id: str, *, engines: int) -> bool:
        """The server of cluster ``server_id`` accepted a Register that reported
        ``engines`` engines; whether they are handed over to it (else they are held)."""
        self.holding_for = ""
        if not server_id or server_id == self.remembered:
            return True
        if self.remembered and engines:
            self.holding_for = server_id
            log.warning(
                "the server is of cluster %s but this agent's %d engine(s) belong to cluster "
                "%s: they keep running and are not handed over; to hand them over to "
                "cluster %s, restart the agent with --join-cluster %s",
                server_id,
                engines,
                self.remembered,
                server_id,
                server_id,
            )
            return False
        if self.remembered:
            log.info("joined cluster %s (was %s; no engines run here)", server_id, self.remembered)
        self._remember(check_cluster_id(server_id, "the server's Registered.cluster_id"))
        return True

    def _read(self) -> str:
        try:
            text = self._path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return ""
        except (OSError, UnicodeDecodeError) as exc:
            raise ClusterIdError(f"{self._path}: cannot read it ({exc})") from exc
        return check_cluster_id(text, str(self._path)) if text else ""

    def _remember(self, cluster_id: str) -> None:
        """Write the id durably (a new file renamed over the old one)."""
        self._path.parent.mkdir(parents=True, exist_ok=True)
        temp = self._path.with_name(f".{CLUSTER_ID_FILE}.{os.getpid()}")
        with temp.open("w", encoding="utf-8") as file:
            file.write(cluster_id + "\n")
            file.flush()
            os.fsync(file.fileno())
        temp.replace(self._path)
        self.remembered = cluster_id
