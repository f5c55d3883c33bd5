"""``llmgw demo``: the whole system on loopback, with traffic, ending in the console.

Real processes, logs under ``STATE_DIR/logs``: ``llmgw server`` with its gateway on free
loopback ports (50051, 8080 and 8000 when free, so ``llmgw get …`` needs no ``--server``),
its engines on ``--engine-ports`` or else 20000-29999 when the bottom of that range is free
and a random free window otherwise (``llmgw.engineports.default_or_window``: a cluster
started with the defaults may be running beside the demo); an ``llmgw agent --simulate
FIXTURE`` per node of ``DEMO_NODES``, running the simulated vLLM as its ``sim`` engine;
``demo_document``'s deployments (KV events on; each engine loads its model for
``--model-load-seconds``, default 3, so starts are cold starts), applied through the API; a light
``Workload`` (``llmgw.cli.demo_traffic``) of chat completions through the gateway sharing
long system prompts, so routing decisions and the engines' prefix caches move; and ``llmgw
console`` on this terminal. Quitting the console stops everything and prints a summary:
replicas READY, requests sent/ok/failed, the gateway's decisions by tier (its ``/metrics``)
and the READY engines' prefix-cache hit rate (Σ ``vllm:prefix_cache_hits_total`` / Σ
``…queries_total``).
``--headless`` (or no terminal) runs the same without the console for ``--duration``
seconds. Ctrl-C or SIGTERM stop it cleanly at any point: the children have sessions of
their own, so the demo stops them in order, then the engines the agents leave for adoption.
A child that exits ends the demo at once with its name, exit status and the end of its
log; a demo that fails keeps its state directory (and so its logs), and says where.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Final, TypeVar

import httpx

from llmgw.addresses import free_port
from llmgw.agent.process import is_running
from llmgw.agent.records import RecordStore
from llmgw.api.llmgw.v1 import ApplyDeploymentRequest, NodeState, ShardState
from llmgw.cli.demo_traffic import (
    MODELS,
    DemoSummary,
    Workload,
    WorkloadConfig,
    decisions_by_tier,
    metric_sum,
    render_summary,
)
from llmgw.cli.errors import CliError
from llmgw.cli.get import run_get
from llmgw.cli.rpc import DEFAULT_WEB_URL
from llmgw.cli.screenlog import logging_to  # the console's own: records off the screen
from llmgw.client import ClientError, ControlClient, GrpcWebChannel
from llmgw.command import LLMGW_COMMAND
from llmgw.engineports import NoFreeWindow, PortRange, default_or_window, format_port_range
from llmgw.server.core.profiles import parse_document
from llmgw.server.errors import ProfileError
from llmgw.signals import stop_on_signals

__all__ = [
    "DEFAULT_LOAD_S",
    "DEMO_DOCUMENT",
    "DemoOptions",
    "demo_document",
    "run_demo",
    "state_dir",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEMO_NODES: Final = (("dgx-1", "dgx-h100"), ("mig-1", "a100-mig"), ("l4-1", "l4-pcie"))
DEMO_DEPLOYMENTS: Final = (
    # deployment (= served model), profile, GPU class, TP, replicas
    ("chat", "chat-h100", "H100", 2, 2),
    ("small", "small-mig", "A100:3g.40gb", 1, 1),
    ("tiny", "tiny-l4", "L4", 1, 1),
)
DEFAULT_LOAD_S: Final = 3.0
"""Each simulated engine's model load in the demo (``llmgw demo --model-load-seconds``)."""


def demo_document(load_s: float = DEFAULT_LOAD_S) -> str:
    """The demo's deployments as ``llmgw apply -f`` reads them: simulated vLLM, KV events
    on, each engine loading its model for ``load_s`` seconds (``--sim-load-seconds``: its
    port opens only then, so every start, a scale-out's too, is a cold start that long)."""
    return "".join(
        f'[profiles.{profile}]\nengine = "sim"\ngpu_class = "{gpu}"\ntp = {tp}\n'
        f'model_path = "/models/{name}"\nserved_model_name = "{name}"\nkv_events = true\n'
        f'args = ["--sim-decode-ms-per-token", "5", "--sim-load-seconds", "{load_s:g}"]\n\n'
        f'[deployments.{name}]\nprofile = "{profile}"\nreplicas = {replicas}\n\n'
        for name, profile, gpu, tp, replicas in DEMO_DEPLOYMENTS
    )


DEMO_DOCUMENT: Final = demo_document()
"""The demo's deployments with the default model load."""

HEADLESS_DURATION_S: Final = 30.0
NODES_READY_S: Final = 60.0
REPLICAS_READY_S: Final = 90.0
POLL_S: Final = 0.3
DEFAULT_GRPC_PORT: Final = 50051  # the server's defaults, when free
DEFAULT_HTTP_PORT: Final = 8080
DEFAULT_GATEWAY_PORT: Final = 8000
SIM_ENGINE_BIN: Final = f"sim={shlex.join(LLMGW_COMMAND)} sim-engine"


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``llmgw demo`` was asked for."""

    headless: bool = False
    duration_s: float | None = None  # None: until the console quits, or Ctrl-C
    state_dir: Path | None = None  # None: a temporary directory, removed afterwards
    rate: float = 3.0  # workload requests per second
    engine_ports: PortRange | None = None  # None: the default range if free, else a window
    load_s: float = DEFAULT_LOAD_S  # each simulated engine's model load (a cold start)
    db: str | None = None  # --db postgresql://…: the server's state there; None: server.db


# --- the processes -------------------------------------------------------------------------


class _Fleet:
    """The server and the agents as child processes, each in a session of its own."""

    def __init__(
        self, root: Path, engine_ports: PortRange | None = None, db: str | None = None
    ) -> None:
        self.root, self.logs = root, root / "logs"
        self.db = db or str(root / "server.db")
        try:
            self.engine_ports = engine_ports or default_or_window()
        except NoFreeWindow as exc:
            raise CliError(f"no engine ports for the demo: {exc}; try --engine-ports") from exc
        self.grpc = f"127.0.0.1:{free_port(DEFAULT_GRPC_PORT)}"
        self.url = f"http://127.0.0.1:{free_port(DEFAULT_HTTP_PORT)}"
        self.gateway = f"http://127.0.0.1:{free_port(DEFAULT_GATEWAY_PORT)}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: dict[int, str] = {}  # pid → which child

    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._spawn("server", "server", "--grpc-listen", self.grpc,
                    "--http-listen", self.url.removeprefix("http://"),
                    "--gateway-listen", self.gateway.removeprefix("http://"),
                    "--db", self.db,
                    "--engine-ports", format_port_range(self.engine_ports))  # fmt: skip
        for node_id, fixture in DEMO_NODES:
            self._spawn(node_id, "agent", "--server", self.grpc, "--node-id", node_id,
                        "--simulate", fixture, "--state-dir", str(self.root / node_id),
                        "--engine-bin", SIM_ENGINE_BIN)  # fmt: skip

    def _spawn(self, name: str, *args: str) -> None:
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen(
                [*LLMGW_COMMAND, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,  # Ctrl-C reaches the demo, which stops them
            )
        self.procs.append(proc)
        self.names[proc.pid] = name

    def exited(self) -> str | None:
        """The first child that exited, its status and the end of its log; None if none."""
        for proc in self.procs:
            code = proc.poll()
            if code is None:
                continue
            name = self.names[proc.pid]
            log = self.logs / f"{name}.log"
            status = f"status {code}" if code >= 0 else f"signal {-code}"
            return f"the {name} process exited ({status}); the end of {log}:\n{_tail(log)}"
        return None

    def check(self) -> None:
        """CliError when a child exited (`exited`)."""
        if (exited := self.exited()) is not None:
            raise CliError(exited)

    def stop(self) -> None:
        """Agents and server (SIGTERM, then SIGKILL), then the engines the agents left."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for node_id, _ in DEMO_NODES:
            _stop_engines(self.root / node_id / "engines")


def _tail(log: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a child's log, indented."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"  (unreadable: {exc.strerror})"
    return "\n".join(f"  {line}" for line in text.splitlines()[-lines:]) or "  (empty)"


def _stop_engines(records: Path, grace_s: float = 5.0) -> None:
    """Stop every engine an agent's records name (agents leave them running for adoption)."""
    found, _ = RecordStore(records).load_all()
    alive = [r.identity for r in found if is_running(r.identity)]
    for identity in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(identity.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [i for i in alive if is_running(i)]
    for identity in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(identity.pid, signal.SIGKILL)


@contextlib.contextmanager
def state_dir(given: Path | None, prefix: str = "llmgw-demo-") -> Iterator[Path]:
    """``given`` (made if missing, kept afterwards), else a temporary folder removed at the
    end unless the block fails (not stopped by Ctrl-C): where a local cluster keeps its
    database, agents' state and logs."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield tmp
    except BaseException as exc:
        stopped = isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, CliError) and exc.exit_code == 130
        )
        if stopped:
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # a failure: what the processes logged is what tells why
            sys.stderr.write(f"llmgw: the state and logs are kept in {tmp}\n")
        raise
    shutil.rmtree(tmp, ignore_errors=True)


# --- the run -------------------------------------------------------------------------------


def run_demo(options: DemoOptions) -> int:
    """``llmgw demo``: 0 after a clean stop; CliError when it could not come up."""
    with state_dir(options.state_dir) as root:
        fleet = _Fleet(root, options.engine_ports, options.db)
        try:
            fleet.start()
            return asyncio.run(_run(fleet, options))
        finally:
            fleet.stop()


async def _run(fleet: _Fleet, options: DemoOptions) -> int:
    stop = asyncio.Event()
    # A closed terminal stops the demo too: its children, in sessions of their own, would
    # outlive it otherwise. (The loop drops the handler when asyncio.run closes it.)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, stop.set)
    console = not options.headless and sys.stdout.isatty()
    nodes = ", ".join(f"{n} ({f})" for n, f in DEMO_NODES)
    _say(f"control server at {fleet.url} (gRPC-web), state and logs in {fleet.root}",
         f"OpenAI-compatible gateway at {fleet.gateway}/v1", f"starting nodes {nodes}, "
         f"engines on ports {format_port_range(fleet.engine_ports)}")  # fmt: skip
    with stop_on_signals(stop):
        async with GrpcWebChannel(fleet.url) as channel:
            client = ControlClient(channel)
            nodes_ready = partial(_nodes_ready, client)
            await _until(stop, fleet, nodes_ready, NODES_READY_S, "the nodes READY")
            expected = await _apply(client, demo_document(options.load_s))
            ready = partial(_replicas_ready, client, expected)
            why = f"{expected} replicas READY (the logs: {fleet.logs})"
            await _until(stop, fleet, ready, REPLICAS_READY_S + options.load_s, why)
            serves = partial(_gateway_serves, fleet.gateway)
            await _until(stop, fleet, serves, 20, "the gateway")
            _say(f"{expected} replicas READY; ~{options.rate:g} chat requests/s through the "
                 "gateway" + ("; opening the console (q quits)" if console else ""))  # fmt: skip
            if not console:
                await _show_cluster(fleet)
            summary = await _with_workload(fleet, options, client, stop, console)
    sys.stdout.write("\nllmgw demo: summary\n" + render_summary(summary) + "\n")
    return 0


def _say(*lines: str) -> None:
    sys.stdout.write("".join(f"llmgw demo: {line}\n" for line in lines))
    sys.stdout.flush()


async def _until(
    stop: asyncio.Event,
    fleet: _Fleet,
    check: Callable[[], Awaitable[T | None]],
    timeout_s: float,
    what: str,
) -> T:
    """Poll ``check`` until it returns something; CliError on a signal, when a child of
    ``fleet`` exits, or in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fleet.check()
        found = await check()
        if found is not None:
            return found
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL_S):
                await stop.wait()
        if stop.is_set():
            raise CliError("stopped before the demo was up", exit_code=130)
    raise CliError(f"timed out after {timeout_s:g}s waiting for {what}")


async def _nodes_ready(client: ControlClient) -> int | None:
    with contextlib.suppress(ClientError):
        cluster = await client.get_cluster()
        ready = sum(n.state == NodeState.READY for n in cluster.nodes)
        return ready if ready >= len(DEMO_NODES) else None
    return None


async def _apply(client: ControlClient, text: str) -> int:
    """Apply every deployment of ``text`` (``demo_document``'s, saying so); returns the
    replicas it asks for."""
    try:
        document = parse_document(text, source="llmgw demo")
    except ProfileError as exc:  # a bug in this module, said plainly
        raise CliError(f"the demo's own deployments are invalid: {exc}") from exc
    for name, deployment in document.deployments.items():
        profile = document.profiles[deployment.profile]
        request = ApplyDeploymentRequest(deployment=deployment, profiles=[profile], document=text)
        try:
            result = await client.apply_deployment(request)
        except ClientError as exc:
            raise CliError(f"applying the demo deployment {name}: {exc}") from exc
        _say(result.message)
    return sum(d.replicas for d in document.deployments.values())


async def _replicas_ready(client: ControlClient, expected: int) -> int | None:
    with contextlib.suppress(ClientError):
        replicas = (await client.get_cluster()).replicas
        ready = sum(r.state == ShardState.READY for r in replicas)
        return ready if ready >= expected else None
    return None


async def _gateway_serves(gateway: str) -> bool | None:
    """True once the gateway lists every model of the demo."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as http:
            models = (await http.get(f"{gateway}/v1/models")).json().get("data", [])
        return True if set(MODELS) <= {m.get("id") for m in models} else None
    return None


async def _show_cluster(fleet: _Fleet) -> None:
    """The cluster as ``llmgw get`` prints it, and what to try next."""
    for kind in ("nodes", "gpus", "replicas"):
        sys.stdout.write("\n")
        await run_get(fleet.url, kind, "table")
    flag = "" if fleet.url == DEFAULT_WEB_URL else f" --server {fleet.url}"
    sys.stdout.write(
        f"\nTry: llmgw console{flag}   |   llmgw get replicas{flag}   |   "
        f"llmgw drain chat-1{flag}\n"
    )
    sys.stdout.flush()


async def _with_workload(
    fleet: _Fleet, options: DemoOptions, client: ControlClient, stop: asyncio.Event,
    console: bool,
) -> DemoSummary:  # fmt: skip
    """Run the workload while the console is open (or for the duration), then sum up."""
    workload = Workload(fleet.gateway, WorkloadConfig(rate=options.rate))
    done = asyncio.Event()
    started = time.monotonic()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(workload.run(done))
        try:
            if console:
                with logging_to(fleet.logs / "demo.log"):
                    await _console(fleet, stop)
            else:
                await _wait(stop, fleet, options)
        finally:
            done.set()
    fleet.check()  # outside the task group: one clean error, not an exception group
    seconds = time.monotonic() - started
    return await _summarize(fleet, client, workload, seconds)


async def _wait(stop: asyncio.Event, fleet: _Fleet, options: DemoOptions) -> None:
    """Until ``stop``, for ``--duration`` (by default HEADLESS_DURATION_S with --headless),
    or until a child of ``fleet`` exits."""
    seconds = options.duration_s
    if seconds is None and options.headless:
        seconds = HEADLESS_DURATION_S
    if seconds is None:
        _say("running; press Ctrl-C to stop")
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await _stopped_or_exited(stop, fleet)


async def _stopped_or_exited(stop: asyncio.Event, fleet: _Fleet) -> None:
    """Until ``stop`` is set or a child of ``fleet`` exits."""
    while fleet.exited() is None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(POLL_S):
                await stop.wait()
        if stop.is_set():
            return


async def _console(fleet: _Fleet, stop: asyncio.Event) -> None:
    """``llmgw console`` on this terminal until it quits (or a signal stops the demo)."""
    args = ["console", "--server", fleet.url, "--log-file", str(fleet.logs / "console.log")]
    proc = await asyncio.create_subprocess_exec(*LLMGW_COMMAND, *args)
    waiter = asyncio.ensure_future(proc.wait())
    stopper = asyncio.ensure_future(_stopped_or_exited(stop, fleet))
    try:
        await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if proc.returncode is None:
            proc.terminate()
        if await waiter and not stop.is_set():
            _say(f"the console exited with status {proc.returncode}")


async def _summarize(
    fleet: _Fleet, client: ControlClient, workload: Workload, seconds: float
) -> DemoSummary:
    unavailable: list[str] = []
    ready, total, endpoints = 0, 0, []
    try:
        replicas = (await client.get_cluster()).replicas
        total = len(replicas)
        live = [r for r in replicas if r.state == ShardState.READY]
        ready, endpoints = len(live), [r.endpoint for r in live if r.endpoint]
    except ClientError as exc:
        unavailable.append(f"the cluster: {exc}")
    async with httpx.AsyncClient(timeout=httpx.Timeout(3.0)) as http:
        gateway = await _metrics_text(http, f"{fleet.gateway}/metrics", unavailable)
        engines = [await _metrics_text(http, f"{e}/metrics", unavailable) for e in endpoints]
    return DemoSummary(
        seconds=seconds,
        replicas_ready=ready,
        replicas_total=total,
        requests=workload.counts(),
        first_error=workload.first_error,
        decisions=decisions_by_tier(gateway),
        prefix_hit_tokens=sum(metric_sum(t, "vllm:prefix_cache_hits_total") for t in engines),
        prefix_query_tokens=sum(metric_sum(t, "vllm:prefix_cache_queries_total") for t in engines),
        unavailable=tuple(unavailable),
    )


async def _metrics_text(http: httpx.AsyncClient, url: str, unavailable: list[str]) -> str:
    try:
        response = await http.get(url)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        unavailable.append(f"{url}: {exc}")
        return ""
    return response.text
