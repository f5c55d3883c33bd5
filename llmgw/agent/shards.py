"""A shard's lifecycle on its agent: the allowed state changes and the restart policy.

Pure values and functions, no I/O. The states are the wire enum ``ShardState`` (each
member documented in protos/llmgw/v1/workload.proto); this module says which changes
between them the supervisor may make::

    PENDING ─→ STARTING ─→ LOADING ─→ READY ─→ DRAINING ─→ STOPPED ─→ PENDING (started again)
       │           │           │         │          │
       └───────────┴───────────┴─────────┴──────────┴─→ FAILED ─→ STARTING (restart after backoff)
                                                          └─→ STOPPED, PENDING (replaced)

A new shard starts PENDING; an engine adopted from a previous agent starts LOADING (its
process is alive, its readiness not yet probed). Stopping a READY engine goes through
DRAINING (it is given its grace to finish what it serves); stopping an engine that is not
serving yet goes straight to STOPPED.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from llmgw.agent.engines.base import LaunchSpec, ShardSpec
from llmgw.agent.errors import ShardTransitionError
from llmgw.api.llmgw.v1 import ShardState

NEW_STATE = ShardState.PENDING
"""The state of a shard the agent was just asked to start."""

ADOPTED_STATE = ShardState.LOADING
"""The state of an engine adopted from a previous agent, until its probe passes."""

TRANSITIONS: Mapping[ShardState, frozenset[ShardState]] = {
    # Accepted, not spawned: spawned; refused (bad profile, exec failed); stopped first.
    ShardState.PENDING: frozenset(
        {ShardState.STARTING, ShardState.FAILED, ShardState.STOPPED},
    ),
    # Spawned, port closed: the port opens; it exits or times out; it is stopped.
    ShardState.STARTING: frozenset(
        {ShardState.LOADING, ShardState.FAILED, ShardState.STOPPED},
    ),
    # Port open, probe not passing: the probe passes; it exits or times out; it is stopped.
    ShardState.LOADING: frozenset(
        {ShardState.READY, ShardState.FAILED, ShardState.STOPPED},
    ),
    # Serving: drained or stopped (both drain first); it dies or stops answering.
    ShardState.READY: frozenset({ShardState.DRAINING, ShardState.FAILED}),
    # No new work, finishing in-flight requests: it stops; it dies meanwhile.
    ShardState.DRAINING: frozenset({ShardState.STOPPED, ShardState.FAILED}),
    # Stopped on purpose: a new StartShard for the same shard starts it again.
    ShardState.STOPPED: frozenset({ShardState.PENDING}),
    # Failed: restarted after the backoff; stopped; replaced by a new StartShard.
    ShardState.FAILED: frozenset(
        {ShardState.STARTING, ShardState.STOPPED, ShardState.PENDING},
    ),
    # Never a state of ours: it only stands for a value a peer did not set.
    ShardState.UNSPECIFIED: frozenset(),
}


def can_transition(current: ShardState, new: ShardState) -> bool:
    """Whether the lifecycle lets a shard move from ``current`` to ``new``."""
    return new in TRANSITIONS.get(current, frozenset())


def check_transition(current: ShardState, new: ShardState) -> None:
    """Raise ShardTransitionError unless ``current → new`` is in the table."""
    if not can_transition(current, new):
        raise ShardTransitionError(f"a shard cannot go from {current.name} to {new.name}")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """Delays before restarting a failed engine: ``base_s`` doubling up to ``cap_s``.

    No jitter: engines restart on one node, not a fleet reconnecting at once. An engine
    that stayed READY for ``stable_s`` starts a new streak when it next fails.
    """

    base_s: float = 10.0
    cap_s: float = 300.0
    factor: float = 2.0
    stable_s: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before the restart that follows ``failures`` failures in a row."""
        if failures <= 0:
            return 0.0
        return min(self.cap_s, self.base_s * self.factor ** (failures - 1))


def engine_env(spec: ShardSpec, launch: LaunchSpec) -> dict[str, str]:
    """What the agent adds to its own environment for this engine.

    The adapter's env, plus ``CUDA_VISIBLE_DEVICES`` set to the shard's GPU (or MIG) UUIDs
    when the shard has GPUs and the adapter did not set it itself.
    """
    env = dict(launch.env)
    if spec.gpu_uuids and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
    return env


def launch_fingerprint(argv: tuple[str, ...], env: Mapping[str, str]) -> str:
    """A stable hash of a command line and the environment added to it."""
    blob = json.dumps({"argv": list(argv), "env": sorted(env.items())}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]
