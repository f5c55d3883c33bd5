"""What an engine adapter turns a shard into: the command line the supervisor runs.

An adapter is pure: from a :class:`ShardSpec` (what the control server asked for, in
``StartShard``) and the configured executable, it builds a :class:`LaunchSpec` (argv, the
environment to add, the port and the probes). The supervisor runs it; nothing here starts
processes, so every command line can be checked exactly in tests.

**The replica's API key never goes on a command line.** ``/proc/PID/cmdline`` (``ps``) is
readable by every user of the node; ``/proc/PID/environ`` only by the engine's owner and
root. So each adapter hands the key over in an environment variable the engine reads itself
(vLLM ``VLLM_API_KEY``, llama.cpp ``LLAMA_API_KEY``; SGLang, which has none, through a
small launcher, see ``sglang.py``), names it in ``LaunchSpec.secret_env``, and refuses a
profile that sets it. Neither ``ShardSpec`` nor ``LaunchSpec`` shows the key in its repr.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Protocol

from llmgw import engineinput
from llmgw.agent.errors import SocketFolderError
from llmgw.agent.ipcdir import short_ipc_dir
from llmgw.api.llmgw.v1 import EngineProfile, MultiNode, StartShard

LOOPBACK = "127.0.0.1"  # engines listen on loopback only (SECURITY.md)
CPU_CLASS = "cpu"  # EngineProfile.gpu_class asking for no GPU
_SHARD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class EngineError(ValueError):
    """A profile cannot be turned into a command line; the message names the field.

    ``field`` is the profile field at fault (``"tp"``, ``"env"``, ``"adapters[1].name"``,
    ``"engine"`` …) or the StartShard field (``"gpu_uuids"``, ``"port"``, ``"shard_id"``,
    ``"multinode.master_port"`` …); ``""`` when none applies. Messages read
    ``FIELD: PROBLEM (profile 'NAME', shard 'ID')``.
    """

    def __init__(self, message: str, *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One shard to run, as the control server described it."""

    shard_id: str
    replica_id: str
    rank: int
    profile: EngineProfile
    fingerprint: str
    gpu_uuids: tuple[str, ...]
    port: int
    api_key: str = field(repr=False)  # a secret: never in a repr, a log or an argv
    multinode: MultiNode | None = None

    @classmethod
    def from_start(cls, message: StartShard) -> ShardSpec:
        if message.profile is None:
            raise EngineError(
                f"StartShard {message.shard_id!r} carries no profile", field="profile"
            )
        return cls(
            shard_id=message.shard_id,
            replica_id=message.replica_id,
            rank=message.rank,
            profile=message.profile,
            fingerprint=message.profile_fingerprint,
            gpu_uuids=tuple(message.gpu_uuids),
            port=message.port,
            api_key=message.api_key,
            multinode=message.multinode,
        )


@dataclass(frozen=True, slots=True)
class KvEventEndpoints:
    """Where an engine publishes KV events: it binds both, the agent connects."""

    endpoint: str  # ipc://STATE_DIR/kv/SHARD.pub
    replay_endpoint: str  # ipc://STATE_DIR/kv/SHARD.replay
    topic: str = "kv-events"

    @property
    def socket_paths(self) -> tuple[Path, ...]:
        """The files behind the ``ipc://`` endpoints: their folder must exist before launch."""
        return tuple(
            Path(e.removeprefix("ipc://"))
            for e in (self.endpoint, self.replay_endpoint)
            if e.startswith("ipc://")
        )


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """A command line and how to tell that it is up.

    ``secret_env`` names the variables of ``env`` that hold a secret (the API key): a repr
    shows them as ``***``, and whoever logs or shows an environment should do the same.
    """

    engine: str
    argv: tuple[str, ...]
    env: Mapping[str, str]  # added to the agent's environment
    port: int
    api_key: str = field(default="", repr=False)  # what probes send; never in argv
    health_path: str = "/health"  # answers 200 once the engine is alive
    ready_path: str = "/v1/models"  # answers 200 (with the API key) once it serves
    kv_events: KvEventEndpoints | None = None
    listens_http: bool = True  # False for headless ranks of a multi-node replica
    secret_env: frozenset[str] = frozenset()  # names in ``env`` whose values are secrets

    def redacted_env(self) -> dict[str, str]:
        """``env`` with the value of every ``secret_env`` variable replaced by ``***``."""
        return {k: "***" if k in self.secret_env else v for k, v in self.env.items()}

    def __repr__(self) -> str:
        return (
            f"LaunchSpec(engine={self.engine!r}, argv={self.argv!r}, "
            f"env={self.redacted_env()!r}, port={self.port!r}, "
            f"kv_events={self.kv_events!r}, listens_http={self.listens_http!r})"
        )


class EngineAdapter(Protocol):
    """Builds the launch of one engine kind."""

    name: str
    default_binary: tuple[str, ...]

    def build(self, spec: ShardSpec, *, binary: Sequence[str], state_dir: Path) -> LaunchSpec:
        """The command line for ``spec``; raises EngineError for a profile it cannot run."""
        ...


@dataclass(frozen=True, slots=True)
class EngineBinaries:
    """The executable (with leading arguments) for each engine, from ``--engine-bin``."""

    overrides: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def for_engine(self, adapter: EngineAdapter) -> tuple[str, ...]:
        return self.overrides.get(adapter.name, adapter.default_binary)


# --- Shared checks and pieces of a command line, used by every adapter ---------------------


def refuse(spec: ShardSpec, field: str, problem: str) -> EngineError:
    """An EngineError naming the field, the profile and the shard."""
    where = f"profile {spec.profile.name!r}, shard {spec.shard_id!r}"
    return EngineError(f"{field}: {problem} ({where})", field=field)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a shard's GPUs are used: parallel sizes and, across nodes, where ranks meet."""

    tp: int
    pp: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0

    @property
    def multinode(self) -> bool:
        return self.nnodes > 1

    @property
    def headless(self) -> bool:
        """A rank other than the leader: it runs workers and serves no HTTP."""
        return self.node_rank > 0


def shard_layout(spec: ShardSpec) -> Layout:
    """Check the parallel sizes against the shard's GPUs; ``tp``/``pp`` of 0 mean 1.

    One node: ``tp * pp`` must equal the number of GPU UUIDs. Several nodes
    (``multinode.nnodes > 1``): each node has ``gpus_per_node`` GPUs and
    ``tp * pp == gpus_per_node * nnodes``. A ``cpu`` profile gets no GPUs.
    """
    profile = spec.profile
    tp, pp = profile.tp or 1, profile.pp or 1
    _check_device_class(spec)
    mn = spec.multinode if spec.multinode is not None and spec.multinode.nnodes > 1 else None
    if mn is None:
        if profile.nodes > 1:
            raise refuse(spec, "nodes", f"{profile.nodes} nodes, but the shard has no multinode")
        if profile.gpu_class != CPU_CLASS and tp * pp != len(spec.gpu_uuids):
            raise refuse(
                spec,
                "tp",
                f"tp*pp = {tp}*{pp} = {tp * pp}, but the shard has {len(spec.gpu_uuids)} GPU(s)",
            )
        return Layout(tp=tp, pp=pp)
    _check_multinode(spec, mn, tp * pp)
    return Layout(tp, pp, mn.nnodes, mn.node_rank, mn.master_addr, mn.master_port)


def _check_device_class(spec: ShardSpec) -> None:
    if spec.profile.gpu_class == CPU_CLASS:
        if spec.gpu_uuids:
            raise refuse(spec, "gpu_class", f"'cpu' asks for no GPU, got {len(spec.gpu_uuids)}")
        return
    if len(spec.gpu_uuids) > 1 and any(u.startswith("MIG-") for u in spec.gpu_uuids):
        # CUDA shows a process only the first MIG device it is given.
        raise refuse(spec, "gpu_uuids", "a process can use one MIG device only")


def _check_multinode(spec: ShardSpec, mn: MultiNode, world: int) -> None:
    profile = spec.profile
    if profile.nodes not in (0, mn.nnodes):
        raise refuse(spec, "nodes", f"{profile.nodes}, but multinode.nnodes is {mn.nnodes}")
    if mn.node_rank >= mn.nnodes:
        raise refuse(spec, "multinode.node_rank", f"{mn.node_rank} >= nnodes {mn.nnodes}")
    if not mn.master_addr:
        raise refuse(spec, "multinode.master_addr", "empty")
    if not 0 < mn.master_port < 65536:
        raise refuse(spec, "multinode.master_port", f"{mn.master_port} is not a port")
    if profile.gpu_class == CPU_CLASS:
        return
    per_node = profile.gpus_per_node
    if per_node == 0 or per_node != len(spec.gpu_uuids):
        raise refuse(
            spec, "gpus_per_node", f"{per_node}, but the shard has {len(spec.gpu_uuids)} GPU(s)"
        )
    if world != per_node * mn.nnodes:
        raise refuse(
            spec, "tp", f"tp*pp = {world}, but gpus_per_node*nnodes = {per_node * mn.nnodes}"
        )


def model_path(spec: ShardSpec) -> str:
    if not spec.profile.model_path:
        raise refuse(spec, "model_path", "required")
    return spec.profile.model_path


def served_model_name(spec: ShardSpec) -> str:
    """The profile's name for the model, else the last component of its path."""
    name = spec.profile.served_model_name or PurePosixPath(model_path(spec)).name
    if not name or any(c.isspace() for c in name):
        raise refuse(spec, "served_model_name", f"{name!r} is not a model name")
    return name


def check_port(spec: ShardSpec) -> int:
    if not 0 < spec.port < 65536:
        raise refuse(spec, "port", f"{spec.port} is not a port")
    return spec.port


def device_env(spec: ShardSpec) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` as the comma-joined GPU (or MIG) UUIDs; none for ``cpu``."""
    if spec.profile.gpu_class == CPU_CLASS:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(spec.gpu_uuids)}


def fabric_env(spec: ShardSpec) -> dict[str, str]:
    """NCCL/Gloo settings from the multinode placement: its HCAs and management interface.

    ``NCCL_IB_HCA`` takes the HCAs by exact name (the leading ``=``), so ``mlx5_1`` does not
    also select ``mlx5_10``.
    """
    mn = spec.multinode
    if mn is None or mn.nnodes <= 1:
        return {}
    env: dict[str, str] = {}
    if mn.hcas:
        env["NCCL_IB_HCA"] = "=" + ",".join(mn.hcas)
    if mn.management_interface:
        env["NCCL_SOCKET_IFNAME"] = mn.management_interface
        env["GLOO_SOCKET_IFNAME"] = mn.management_interface
    return env


# Variables the agent sets and a profile may not, with the reason given when one tries.
AGENT_ENV: Mapping[str, str] = MappingProxyType({"CUDA_VISIBLE_DEVICES": "from the shard's GPUs"})
KEY_REASON = "from the replica's API key"


def api_key_env(spec: ShardSpec, variable: str, *, serves_http: bool = True) -> dict[str, str]:
    """``{variable: key}`` for an engine that reads its API key from ``variable``.

    Empty when the shard has no key, or when the process serves no HTTP (a headless rank):
    a key it would not use stays off that node.
    """
    return {variable: spec.api_key} if spec.api_key and serves_http else {}


def merge_profile_env(
    spec: ShardSpec, env: Mapping[str, str], owned: Mapping[str, str] = AGENT_ENV
) -> dict[str, str]:
    """``env`` with the profile's env merged over it; a key in ``owned`` is refused, and so
    is every name or value :func:`llmgw.engineinput.env_problem` refuses."""
    for key in sorted(spec.profile.env):
        if key in owned:
            raise refuse(spec, "env", f"{key} is set by the agent {owned[key]}")
        value = spec.profile.env[key]
        if why := engineinput.env_problem(key, value, kv_events=spec.profile.kv_events):
            raise refuse(spec, "env", f"{key!r}: {why}")
    return {**env, **spec.profile.env}


def check_profile_args(spec: ShardSpec) -> tuple[str, ...]:
    """The profile's extra args, refused if one sets a flag the adapter manages or loads code.

    :func:`llmgw.engineinput.refused_flags` says which flags, and
    :func:`~llmgw.engineinput.arg_problem` in which spellings (``--flag=value``,
    ``--flag_name``, dotted sub-keys, argparse abbreviations).
    """
    profile = spec.profile
    multinode = profile.nodes > 1 or (spec.multinode is not None and spec.multinode.nnodes > 1)
    refused = engineinput.refused_flags(
        profile.engine, kv_events=profile.kv_events, multinode=multinode
    )
    for i, arg in enumerate(profile.args):
        if why := engineinput.arg_problem(profile.engine, arg, refused):
            raise refuse(spec, "args", f"args[{i}] {arg!r}: {why}")
    return tuple(profile.args)


def check_engine(spec: ShardSpec) -> None:
    """Refuse what the engine cannot do (:func:`llmgw.engineinput.engine_problems`, the rule
    the server applies at apply too), naming the first field."""
    if problems := engineinput.engine_problems(spec.profile):
        (path, why), *_ = problems
        raise refuse(spec, str(path[0]), why)


def check_profile(spec: ShardSpec) -> None:
    """Refuse a profile that :func:`llmgw.engineinput.profile_problems` refuses, before any
    adapter sees it: the control server checked it, and the agent checks again."""
    multinode = spec.multinode is not None and spec.multinode.nnodes > 1
    problems = engineinput.profile_problems(spec.profile, multinode=multinode)
    if problems:
        raise refuse(spec, str(problems[0][0][0]), engineinput.describe(problems))


# A Unix socket path holds at most 107 bytes (sun_path is 108 with the NUL).
UNIX_PATH_MAX = 107


def kv_event_endpoints(spec: ShardSpec, state_dir: Path, topic: str) -> KvEventEndpoints:
    """``ipc://STATE_DIR/kv/SHARD.pub`` and ``.replay``, or a short path when too long.

    When either path passes the Unix socket limit, both move to ``D/H.pub`` and
    ``D/H.replay`` in this agent's short socket folder D (`llmgw.agent.ipcdir.short_ipc_dir`:
    ``/tmp/llmgw-kv-`` and a random name, mode 0700, the same after an agent restart, so
    the agent finds a running engine's sockets again), where H is the first 24 hex digits
    of sha256(shard id). Creating or checking that folder may refuse (EngineError on
    ``kv_events``) when it is not the agent's alone.
    """
    if not _SHARD_ID.fullmatch(spec.shard_id):
        raise refuse(spec, "shard_id", "not usable in a file name ([A-Za-z0-9._-], 1-128)")
    state_dir = state_dir.absolute()
    folder = state_dir / "kv"
    pub, replay = folder / f"{spec.shard_id}.pub", folder / f"{spec.shard_id}.replay"
    if max(len(os.fsencode(pub)), len(os.fsencode(replay))) > UNIX_PATH_MAX:
        try:
            short = short_ipc_dir(state_dir)
        except (SocketFolderError, OSError) as exc:
            raise refuse(spec, "kv_events", f"no socket folder: {exc}") from exc
        name = hashlib.sha256(spec.shard_id.encode()).hexdigest()[:24]
        pub, replay = short / f"{name}.pub", short / f"{name}.replay"
    return KvEventEndpoints(f"ipc://{pub}", f"ipc://{replay}", topic)
