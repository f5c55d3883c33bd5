"""The HTTP benchmark's constants and its ``Settings``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

FIXTURE: Final = "dgx-h100"
CHALLENGERS: Final = ("llmgw", "hypercorn")
GET_CLUSTER: Final = "/llmgw.v1.ControlService/GetCluster"
MAX_MESSAGE_BYTES: Final = 4 << 20  # as ``llmgw server`` defaults
HYPERCORN_KEEPALIVE_REQUESTS: Final = 1 << 30  # its default (1,000) closes every 1,000th reply
CELL_GRACE_S: Final = 30.0  # beyond warmup + window, how long a cell may take at most


@dataclass(frozen=True, slots=True)
class Settings:
    nodes: int
    conns: int
    reps: int
    seconds: float
    warmup_s: float
    max_requests: int
    server_cpu: int
    client_cpu: int
    max_others: float  # a cell where other processes used more of the server's CPU is re-run
    attempts: int  # at most this many runs of a cell; the quietest is kept
