"""``llmgw agent``: discover this node, then keep its stream to the control server open.

The node id is chosen once and kept in the state directory (``node-id``), so an agent
restarted with the same ``--state-dir`` comes back as the same node; so is the cluster its
engines belong to (``cluster-id``, ``llmgw.agent.cluster``; ``--join-cluster`` replaces it),
and a random instance id (``instance-id``): with the host's machine id it names this agent
to the server, which refuses a second agent of a node while the first one is live and names
the holder by them. The state directory holds engine API keys: it and everything in it are
owner-only (0700/0600), tightened on start if found looser (``llmgw.statefiles``). Discovery is the
simulated backend when ``--simulate`` names a fixture; otherwise NVML describes the GPUs
(with no driver the agent reports this host and no GPUs, saying why).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import ssl
import urllib.parse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmgw import __version__
from llmgw.addresses import AddressError, bracketed, parse_host_port, state_home
from llmgw.agent.backoff import BackoffPolicy
from llmgw.agent.cluster import ClusterIdError, ClusterMembership
from llmgw.agent.discovery import NvmlTelemetry, SimulatedTelemetry, nvml_node, simulated_node
from llmgw.agent.engines import build_launch
from llmgw.agent.engines.base import EngineBinaries, LaunchSpec, ShardSpec
from llmgw.agent.epoch import EpochFileError, LeaderEpoch
from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.kvhub import KvEventHub
from llmgw.agent.link import AgentLink, LinkConfig
from llmgw.agent.logfiles import DEFAULT_MAX_BYTES, DEFAULT_RETENTION_S, prune
from llmgw.agent.logserve import LogStreams
from llmgw.agent.shards import RestartPolicy
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.api.llmgw.v1 import GpuTelemetry, NodeInfo, ShardState
from llmgw.printable import text_problem
from llmgw.protocol import NODE_ID_RULE, valid_node_id
from llmgw.signals import stop_on_signals
from llmgw.statefiles import FILE_MODE, private_tree
from llmgw.tls import ALPN_GRPC, TlsFileError, client_context

log = logging.getLogger(__name__)

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
LOG_PRUNE_S = 600.0
"""How often the agent looks for logs of gone shards to remove."""
_INSTANCE_ID = re.compile(r"[0-9a-fA-F-]{8,64}")


class AgentConfigError(ValueError):
    """A flag of ``llmgw agent`` is malformed; the message names it."""


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/llmgw/agent`` (``~/.local/state/llmgw/agent``)."""
    return state_home() / "llmgw" / "agent"


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything ``llmgw agent`` is told on its command line."""

    server_host: str
    server_port: int
    state_dir: Path
    more_servers: tuple[tuple[str, int], ...] = ()  # --server a,b,c: the ones after the first
    node_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    simulate: str | None = None
    hostname: str = field(default_factory=socket.gethostname)
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    model_dirs: tuple[Path, ...] = ()  # where local weights are looked for
    storage_paths: tuple[Path, ...] = ()  # whose filesystems are reported
    engine_bins: EngineBinaries = field(default_factory=EngineBinaries)  # --engine-bin
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # --restart-backoff[-max]
    startup_timeout_s: float = 900.0  # --startup-timeout
    drain_settle_s: float = 2.0  # --drain-settle
    log_max_bytes: int = DEFAULT_MAX_BYTES  # --log-max-bytes: rotate an engine's log past it
    log_retention_s: float = DEFAULT_RETENTION_S  # --log-retention: keep a gone shard's logs
    kv_events: KvFollowConfig = field(default_factory=KvFollowConfig)
    token: str | None = field(default=None, repr=False)  # --token-file; never logged
    ca_file: Path | None = None  # --ca-file: TLS to the server, verified against this CA
    join_cluster: str | None = None  # --join-cluster: hand the engines to this cluster


def parse_servers(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT,HOST:PORT,...`` → the addresses in order, a repeated one kept once; a
    malformed or empty entry is an AgentConfigError naming it."""
    servers: list[tuple[str, int]] = []
    for entry in text.split(","):
        if not entry.strip():
            raise AgentConfigError(f"--server {text!r} has an empty entry (HOST:PORT,HOST:PORT)")
        server = parse_server(entry.strip())
        if server not in servers:
            servers.append(server)
    return servers


def parse_server(text: str) -> tuple[str, int]:
    """``HOST:PORT`` → (host, port); a malformed value names the flag.

    A URL (``http://host:8080``, the form the CLI's gRPC-web ``--server`` takes) is refused
    at once, with the value to use instead: its host would never resolve, and the agent
    would retry it forever.
    """
    if "://" in text:
        raise AgentConfigError(_url_refusal(text))
    try:
        return parse_host_port(text, port_zero=False)
    except AddressError as exc:
        raise AgentConfigError(
            f"--server {text!r} is not HOST:PORT (for example 127.0.0.1:50051): {exc}"
        ) from None


def _url_refusal(text: str) -> str:
    url = urllib.parse.urlsplit(text)
    try:
        port = url.port
    except ValueError:
        port = None
    host = url.hostname or "HOST"
    suggestion = f"{bracketed(host)}:{port or 50051}"
    return (
        f"--server {text!r} is a URL; the agent takes the control server's gRPC HOST:PORT "
        f"(its --listen, default port 50051), not a URL: try --server {suggestion}"
    )


def parse_labels(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` → dict; a pair without ``=``, with an empty key or with a control
    character (which would forge rows where labels are printed) is refused."""
    labels: dict[str, str] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise AgentConfigError(f"--labels: {pair!r} is not key=value")
        if why := text_problem(pair):
            raise AgentConfigError(f"--labels: {pair!r} {why}")
        labels[key.strip()] = value.strip()
    return labels


def parse_hostname(text: str) -> str:
    """``--hostname``: any text without a control character."""
    if not text or (why := text_problem(text)):
        raise AgentConfigError(f"--hostname {text!r} {why or 'is empty'}")
    return text


def resolve_node_id(state_dir: Path, explicit: str | None) -> str:
    """The node id: ``explicit``, else the one kept in the state directory, else a new one."""
    path = state_dir / "node-id"
    if explicit is not None:
        node_id = explicit
    elif path.exists():
        node_id = path.read_text().strip()
    else:
        node_id = f"{socket.gethostname().split('.')[0]}-{uuid.uuid4().hex[:8]}"
    if not valid_node_id(node_id):
        raise AgentConfigError(f"node id {node_id!r} is not valid ({NODE_ID_RULE})")
    private_tree(state_dir)  # engine keys live here: 0700, its files 0600
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as file:
        file.write(node_id + "\n")
    return node_id


def resolve_instance_id(state_dir: Path) -> str:
    """This agent's instance id: kept in ``STATE_DIR/instance-id``, created once."""
    path = state_dir / "instance-id"
    try:
        instance_id = path.read_text().strip()
    except FileNotFoundError:
        instance_id = ""
    if not _INSTANCE_ID.fullmatch(instance_id):
        instance_id = uuid.uuid4().hex
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(instance_id + "\n")
    return instance_id


def machine_id(paths: Sequence[Path] = MACHINE_ID_FILES) -> str:
    """The host's machine id (systemd's, else D-Bus's); '' when neither can be read."""
    for path in paths:
        try:
            value = path.read_text().strip()
        except OSError:
            continue
        if _INSTANCE_ID.fullmatch(value):
            return value
    return ""


def discover(config: AgentConfig, node_id: str) -> NodeInfo:
    """What this node is: a simulated fixture, or this host as NVML and its files say."""
    if config.simulate:
        node = simulated_node(
            config.simulate, node_id=node_id, hostname=config.hostname, labels=config.labels
        )
    else:
        node = nvml_node(
            node_id=node_id,
            hostname=config.hostname,
            labels=config.labels,
            model_dirs=config.model_dirs,
            storage_paths=_storage_paths(config),
        )
    node.agent_version = __version__
    node.features = sorted({*node.features, "heartbeat-deltas"})
    return node


def _server_tls(ca_file: Path | None) -> ssl.SSLContext | None:
    """The TLS context for the server's stream: none without a CA file."""
    if ca_file is None:
        return None
    try:
        return client_context(ca_file, ALPN_GRPC)
    except TlsFileError as exc:
        raise AgentConfigError(str(exc)) from exc


def _storage_paths(config: AgentConfig) -> list[Path]:
    """The storage paths and model directories (each once), else the state directory."""
    paths = list(dict.fromkeys([*config.storage_paths, *config.model_dirs]))
    return paths or [config.state_dir]


class Agent:
    """The agent process: discovery plus the link to the server."""

    def __init__(self, config: AgentConfig) -> None:
        tls = _server_tls(config.ca_file)  # a bad CA file stops the agent before anything runs
        self.config = config
        self.node_id = resolve_node_id(config.state_dir, config.node_id)
        self.instance_id = resolve_instance_id(config.state_dir)
        self.node = discover(config, self.node_id)
        try:
            self.membership = ClusterMembership(config.state_dir, join=config.join_cluster)
            self.epoch = LeaderEpoch(config.state_dir)
        except (ClusterIdError, EpochFileError) as exc:
            raise AgentConfigError(str(exc)) from exc
        self._telemetry = self._sampler()
        self.kv = KvEventHub(config.kv_events)  # the engines' KV blocks, for the stream
        self.supervisor = Supervisor(
            SupervisorConfig(
                state_dir=config.state_dir,
                restart=config.restart,
                startup_timeout_s=config.startup_timeout_s,
                drain_settle_s=config.drain_settle_s,
                log_max_bytes=config.log_max_bytes,
                node_id=self.node_id,
                wait_for_server=True,
            ),
            launcher=self._launch,
            on_status=lambda status: self.link.send_status(status),
            kv=self.kv,
        )
        self.logs = LogStreams(
            self.supervisor.config.log_dir,
            lambda chunk: self.link.send_log(chunk),
            node_id=self.node_id,
            running=self._runs,
        )
        self.link = AgentLink(
            LinkConfig(
                config.server_host,
                config.server_port,
                more_servers=config.more_servers,
                backoff=config.backoff,
                token=config.token,
                tls=tls,
                instance_id=self.instance_id,
                machine_id=machine_id(),
            ),
            node=lambda: self.node,
            telemetry=self.telemetry,
            shards=self.supervisor.statuses,
            on_command=self.supervisor.handle,
            kv=self.kv,
            membership=self.membership,
            on_registered=self.supervisor.licence,
            logs=self.logs,
            epoch=self.epoch,
        )

    def _runs(self, shard_id: str) -> bool:
        """Whether this agent runs the shard (a follow of its log goes on while it does)."""
        status = self.supervisor.status(shard_id)
        return status is not None and status.state is not ShardState.STOPPED

    def _launch(self, spec: ShardSpec) -> LaunchSpec:
        return build_launch(spec, binaries=self.config.engine_bins, state_dir=self.config.state_dir)

    def _sampler(self) -> SimulatedTelemetry | NvmlTelemetry | None:
        if self.config.simulate:
            seed = int.from_bytes(self.node_id.encode()[-8:].rjust(8, b"\0"), "big")
            return SimulatedTelemetry(self.node, seed=seed)
        return NvmlTelemetry(self.node) if self.node.gpus else None

    def telemetry(self) -> Sequence[GpuTelemetry]:
        return self._telemetry.sample() if self._telemetry is not None else []

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Run until SIGINT/SIGTERM (or ``stop``).

        Engines are adopted before the first registration (and started again, or stopped,
        only once the server accepted it: see ``Supervisor.licence``); they keep running
        when the agent stops, so that the next agent adopts them.
        """
        stop = stop or asyncio.Event()
        await self.supervisor.open()
        log.info(
            "agent %s (%s) starting; server %s:%d",
            self.node_id,
            self.node.discovery,
            self.config.server_host,
            self.config.server_port,
        )
        link = asyncio.create_task(self.link.run(), name="link")
        pruner = asyncio.create_task(self._prune_logs(), name="log-pruner")
        try:
            with stop_on_signals(stop):
                await stop.wait()
        finally:
            link.cancel()
            pruner.cancel()
            await asyncio.gather(link, pruner, return_exceptions=True)
            await self.logs.reset()
            await self.supervisor.close()
            await self.kv.aclose()
            if isinstance(self._telemetry, NvmlTelemetry):
                self._telemetry.close()
        log.info("agent %s stopped", self.node_id)

    async def _prune_logs(self) -> None:
        """Remove the logs of shards this agent no longer runs, ``log_retention_s`` after
        their last write; checked at the start and then every ``LOG_PRUNE_S``."""
        while True:
            running = {status.shard_id for status in self.supervisor.statuses()}
            log_dir = self.supervisor.config.log_dir
            retention = self.config.log_retention_s
            for path in await asyncio.to_thread(prune, log_dir, running, retention):
                log.info("removed %s: its shard ended over %g s ago", path.name, retention)
            await asyncio.sleep(min(LOG_PRUNE_S, retention))
