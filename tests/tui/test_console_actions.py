"""The console's operator actions.

Pure: what each plan says about its targets and impact, and the RPC ``send`` makes. Then,
through Pilot against a real ``llmgw server`` with two simulated DGX agents running
``llmgw sim-engine`` engines (one fleet for the module; the tests run in order and each
reads the state it finds): per action, the key, the modal (its words name the target and
the impact; Cancel has the focus), confirming, the RPC reaching the server (``llmgw get …
-o json`` and ``llmgw events``, as an operator would check), the outcome notification, and
the state changing on screen. Cancel sends nothing; a refusal comes back with the server's
message at error severity; read-only shows no verb and its client refuses a forced one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from textual.notifications import SeverityLevel
from textual.pilot import Pilot
from textual.widgets import Button, OptionList

from llmgw.addresses import free_port
from llmgw.agent.process import is_running
from llmgw.agent.records import RecordStore
from llmgw.api.llmgw.v1 import (
    ActionResult,
    Cluster,
    Deployment,
    EngineProfile,
    Gpu,
    GpuHealth,
    Health,
    Node,
    NodeInfo,
    NodeState,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.client import ClientError, ControlClient, GrpcWebChannel
from llmgw.engineports import format_port_range, pick_window
from llmgw.tui import app as app_module
from llmgw.tui.actions import (
    ActionUnavailable,
    DrainPlacement,
    Operation,
    Verb,
    drain_placement,
    plan_cordon,
    plan_drain,
    plan_drain_node,
    plan_reprofile,
    plan_start,
    plan_uncordon,
    profile_choice,
    send,
)
from llmgw.tui.app import ConsoleApp
from llmgw.tui.modals import ChoiceScreen, ConfirmScreen
from llmgw.tui.model import ClusterModel, ConsoleSnapshot
from llmgw.tui.stream import Backoff, WatchConfig, WatchSession
from llmgw.tui.views.table import TableView

T0 = 1_700_000_000_000
GiB = 1 << 30

# --- the plans, pure -----------------------------------------------------------------------


def _node(node_id: str, gpus: int = 4, *, cordoned: bool = False) -> Node:
    devices = [
        Gpu(index=i, uuid=f"GPU-{node_id}-{i}", gpu_class="H100", memory_total_bytes=80 * GiB,
            health=GpuHealth(health=Health.HEALTHY))
        for i in range(gpus)
    ]  # fmt: skip
    info = NodeInfo(node_id=node_id, hostname=node_id, gpus=devices)
    return Node(info=info, state=NodeState.READY, connected=True, cordoned=cordoned)


def _shard(replica: str, node_id: str, gpus: tuple[int, ...], state: ShardState) -> Shard:
    status = ShardStatus(
        shard_id=f"{replica}.0", replica_id=replica, state=state,
        gpu_uuids=[f"GPU-{node_id}-{i}" for i in gpus], since_unix_ms=T0,
    )  # fmt: skip
    return Shard(shard_id=f"{replica}.0", replica_id=replica, node_id=node_id, status=status)


def _replica(replica_id: str, state: ShardState, deployment: str = "chat") -> Replica:
    return Replica(replica_id=replica_id, deployment=deployment, profile="chat-a",
                   model=deployment, state=state, shard_ids=[f"{replica_id}.0"])  # fmt: skip


def fleet_snapshot(*, a2_cordoned: bool = False) -> ConsoleSnapshot:
    """chat-1, chat-2 READY on a1; chat-3 STARTING on a2; chat-4 DRAINING on a2; a3 empty;
    embed-1 READY on a3 (another deployment and model)."""
    ready, starting, draining = ShardState.READY, ShardState.STARTING, ShardState.DRAINING
    cluster = Cluster(
        nodes=[_node("a1"), _node("a2", cordoned=a2_cordoned), _node("a3", 2)],
        shards=[
            _shard("chat-1", "a1", (0, 1), ready), _shard("chat-2", "a1", (2, 3), ready),
            _shard("chat-3", "a2", (0, 1), starting), _shard("chat-4", "a2", (2, 3), draining),
            _shard("embed-1", "a3", (0,), ready),
        ],
        replicas=[
            _replica("chat-1", ready), _replica("chat-2", ready), _replica("chat-3", starting),
            _replica("chat-4", draining), _replica("embed-1", ready, "embed"),
        ],
        deployments=[Deployment(name="chat", profile="chat-a", replicas=3),
                     Deployment(name="embed", profile="embed-a", replicas=1)],
    )  # fmt: skip
    model = ClusterModel()
    model.apply(WatchEvent(revision=1, snapshot=cluster), T0)
    return model.snapshot(T0)


def test_drain_names_the_replica_and_the_ready_capacity_it_takes() -> None:
    snap = fleet_snapshot()
    op = plan_drain(snap, "chat-2")
    assert (op.verb, op.target, op.title, op.confirm) == (
        Verb.DRAIN, "chat-2", "Drain replica chat-2", "Drain")  # fmt: skip
    assert op.targets == ("replica chat-2: READY, deployment chat, profile chat-a, on a1, 2 GPUs",)
    assert op.impact == (
        "chat-2 serves 1 of 2 READY replicas of deployment chat; its in-flight requests "
        "finish first.",
        "Deployment chat scales down from 3 replicas to 2; nothing replaces chat-2.",
        "Frees 2 GPUs on a1.",
    )
    starting = plan_drain(snap, "chat-3").impact[0]
    assert starting == (
        "chat-3 is STARTING: it serves no requests; READY replicas of deployment chat stay at 2."
    )
    last = plan_drain(snap, "embed-1").impact[0]
    assert last.endswith("No READY replica of model embed is left after it.")
    with pytest.raises(ActionUnavailable, match="replica chat-9 is not in the cluster"):
        plan_drain(snap, "chat-9")


def test_start_and_reprofile_name_the_deployment_and_what_rolls() -> None:
    snap = fleet_snapshot()
    start = plan_start(snap, "chat")
    assert (start.verb, start.target) == (Verb.START, "chat")
    assert start.targets == ("deployment chat: profile chat-a, model chat",)
    assert start.impact[0].startswith("Deployment chat scales up from 3 replicas to 4;")
    assert start.impact[1] == "READY now: 2 of 3. Nothing running stops."
    with pytest.raises(ActionUnavailable):
        plan_start(snap, "nope")
    chat_b = profile_choice(EngineProfile(
        name="chat-b", engine="sim", gpu_class="H100", tp=2, pp=1, gpus_per_node=2, nodes=1,
        served_model_name="chat", args=["--max-model-len", "4096"],
    ))  # fmt: skip
    assert chat_b.gpus == 2
    assert chat_b.summary == "sim · 2×H100 · tp 2 · chat · --max-model-len 4096"
    op = plan_reprofile(snap, "chat", "chat-a", chat_b)
    assert (op.verb, op.target, op.profile) == (Verb.REPROFILE, "chat", "chat-b")
    assert op.targets == (
        "deployment chat: profile chat-a → chat-b",
        "replicas replaced: chat-1, chat-2, chat-3",  # chat-4 drains anyway
    )
    assert "READY stays at 2" in op.impact[0]
    assert op.impact[1].startswith("Meanwhile one extra replica needs 2 GPUs (H100).")
    with pytest.raises(ActionUnavailable, match="uses profile chat-a already"):
        plan_reprofile(snap, "chat", "chat-a", profile_choice(EngineProfile(name="chat-a")))


def test_node_plans_say_what_keeps_running_what_moves_and_where_there_is_room() -> None:
    snap = fleet_snapshot()
    cordon = plan_cordon(snap, "a1")
    assert cordon.targets == ("node a1: READY, 4×H100",)
    assert cordon.impact == (
        "Nothing new is placed on a1; what runs there keeps running: chat-1, chat-2.",
        "Nodes open for placement: 3 → 2 of 3.",
    )
    drain = plan_drain_node(snap, "a1")
    assert drain.targets == ("node a1: READY, 4×H100", "replicas moving: chat-1, chat-2")
    assert drain.impact[-1] == (
        "Where they would go is not known (not asked): the server places them."
    )
    answer = (
        "dry run: drain node a1: 2 replicas to move, 1 can move now; nothing was changed\n"
        "chat-1: → chat-5 on a3 GPUs 0,1 (H100)\n"
        "chat-2: cannot move (no node has 2 H100 free); it keeps running on a1 until there is room"
    )
    placed = plan_drain_node(snap, "a1", drain_placement(answer))
    assert placed.impact[-3:] == (
        "Where the server's placement would put them now (a dry run, nothing changed):",
        "chat-1: → chat-5 on a3 GPUs 0,1 (H100)",
        "chat-2: cannot move (no node has 2 H100 free); it keeps running on a1 until there is room",
    )
    failed = plan_drain_node(snap, "a1", DrainPlacement(unknown="the server's dry run failed"))
    assert "not known (the server's dry run failed)" in failed.impact[-1]
    moving_a2 = plan_drain_node(snap, "a2").targets
    assert moving_a2[1] == "replicas moving: chat-3"  # chat-4 is DRAINING already
    assert plan_drain_node(fleet_snapshot(), "a3").targets[1] == "replicas moving: embed-1"
    assert plan_uncordon(snap, "a1").impact == ("a1 is not cordoned: nothing changes.",)
    cordoned = fleet_snapshot(a2_cordoned=True)
    assert plan_cordon(cordoned, "a2").impact == ("a2 is cordoned already: nothing changes.",)
    assert plan_uncordon(cordoned, "a2").impact[1] == "Nodes open for placement: 2 → 3 of 3."
    assert plan_uncordon(cordoned, "a2").impact[2] == (
        "A drain of a2 not finished yet is cancelled: chat-3 stays on a2 under its id."
    )
    assert plan_cordon(cordoned, "a2").targets == ("node a2: CORDONED, 4×H100",)


class RecordingClient:
    """Stands in for ControlClient in ``send``: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        async def call(*args: Any, **kwargs: Any) -> ActionResult:
            self.calls.append((name, args, kwargs))
            return ActionResult(ok=True, message=name)

        return call


async def test_send_makes_the_one_rpc_each_verb_stands_for() -> None:
    client = RecordingClient()
    for verb, target, profile in [
        (Verb.DRAIN, "chat-1", ""), (Verb.START, "chat", ""), (Verb.REPROFILE, "chat", "b"),
        (Verb.CORDON, "a1", ""), (Verb.UNCORDON, "a1", ""), (Verb.DRAIN_NODE, "a2", ""),
    ]:  # fmt: skip
        op = Operation(verb, target, "t", (), (), "ok", profile=profile)
        await send(op, client)  # type: ignore[arg-type]
    assert client.calls == [
        ("drain_replica", ("chat-1",), {}),
        ("start_replica", ("chat",), {}),
        ("reprofile_replica", ("",), {"deployment": "chat", "profile": "b"}),
        ("cordon_node", ("a1",), {}),
        ("uncordon_node", ("a1",), {}),
        ("drain_node", ("a2",), {}),
    ]


# --- a real fleet --------------------------------------------------------------------------

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
PROFILES = Path(__file__).parents[1] / "data" / "profiles" / "good-chat-a-b.toml"
# a profile of another model: the reprofile list leaves it out
PHI = '\n[profiles.phi]\nengine = "sim"\ngpu_class = "H100"\nmodel_path = "/models/phi"\n'
CHAT = PROFILES.read_text() + PHI + '\n[deployments.chat]\nprofile = "chat-a"\nreplicas = 2\n'
READY = "SHARD_STATE_READY"
QUICK = WatchConfig(backoff=Backoff(first_s=0.2, max_s=1.0), idle_s=5.0, frame_s=0.1)


def _wait(check: Callable[[], Any], seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out after {seconds}s waiting for {what}")


@dataclass
class Fleet:
    """``llmgw server`` and two ``llmgw agent --simulate dgx-h100`` with sim engines."""

    root: Path
    grpc: int
    http: int
    procs: dict[str, subprocess.Popen[bytes]]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def spawn(self, name: str, *args: str) -> None:
        with (self.root / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "llmgw", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip

    def start(self) -> None:
        self.spawn(
            "server", "server", "--grpc-listen", f"127.0.0.1:{self.grpc}", "--http-listen",
            f"127.0.0.1:{self.http}", "--gateway-listen", "off", "--db",
            str(self.root / "server.db"),
            # engine ports of its own: the suite's other fleets run beside it
            "--engine-ports", format_port_range(pick_window()),
        )  # fmt: skip
        _wait(self._healthy, 60, "the server's /healthz")  # a start on a loaded CI machine
        for node_id in ("a1", "a2"):
            self.spawn(
                node_id, "agent", "--server", f"127.0.0.1:{self.grpc}", "--node-id", node_id,
                "--simulate", "dgx-h100", "--state-dir", str(self.root / node_id),
                "--engine-bin", SIM_BIN, "--restart-backoff", "1", "--restart-backoff-max", "1",
            )  # fmt: skip
        ready = {"a1": "NODE_STATE_READY", "a2": "NODE_STATE_READY"}
        _wait(lambda: self.node_states() == ready, 40, "both agents READY")
        (self.root / "chat.toml").write_text(CHAT)
        self.cli("apply", "-f", str(self.root / "chat.toml"))
        try:
            _wait(lambda: len(self.ready_replicas()) == 2, 120, "2 READY replicas")
        except AssertionError as exc:
            logs = "\n".join(f"--- {n}\n{self.log_tail(n)}" for n in ("server", "a1", "a2"))
            raise AssertionError(f"{exc}; replicas: {self.get('replicas')}\n{logs}") from exc

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = (self.root / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "llmgw", *args, "--server", self.url],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return out.stdout

    def get(self, kind: str) -> list[dict[str, Any]]:
        return list(json.loads(self.cli("get", kind, "-o", "json"))[kind])

    def node_states(self) -> dict[str, str]:
        return {n["info"]["nodeId"]: n.get("state", "") for n in self.get("nodes")}

    def ready_replicas(self) -> list[dict[str, Any]]:
        return [r for r in self.get("replicas") if r.get("state") == READY]

    def events(self) -> list[str]:
        return self.cli("events").splitlines()[1:]

    def operator_events(self) -> list[str]:
        """The audit log but the reconciler's own records (a round may land any time)."""
        return [line for line in self.events() if line.split()[1:2] != ["reconciler"]]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for records in self.root.glob("*/engines"):  # engines the agents left running
            found, _ = RecordStore(records).load_all()
            for record in found:
                if is_running(record.identity):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(record.identity.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("fleet"), free_port(), free_port(), {})
    try:
        f.start()
        yield f
    finally:
        f.stop()


@pytest.fixture
async def channel(fleet: Fleet) -> AsyncIterator[GrpcWebChannel]:
    async with GrpcWebChannel(fleet.url) as ch:
        yield ch


class RecordingApp(ConsoleApp):
    """The console, keeping each notification it shows."""

    CSS_PATH = str(Path(app_module.__file__).with_name("app.tcss"))  # not beside this file

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, str, SeverityLevel]] = []

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:  # fmt: skip
        self.notes.append((title, message, severity))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)


def console(channel: GrpcWebChannel, fleet: Fleet, view: str, *, read_only: bool = False
            ) -> RecordingApp:  # fmt: skip
    client = ControlClient(channel, read_only=read_only)
    return RecordingApp(WatchSession(client, QUICK), client=client, server=fleet.url, view=view)


def screen_text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def flat(app: ConsoleApp) -> str:
    """The screen's words with box lines and wrapping gone: sentences read across lines."""
    text = screen_text(app)
    for char in "│╭╮╰╯─▊▎▔▁":
        text = text.replace(char, " ")
    return " ".join(text.split())


def line_of(app: ConsoleApp, *words: str) -> str:
    """The first screen line holding every one of ``words`` ("" when none)."""
    return next((ln for ln in screen_text(app).splitlines() if all(w in ln for w in words)), "")


async def until(pilot: Pilot[Any], check: Callable[[], object], seconds: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            app = pilot.app
            seen = screen_text(app) if isinstance(app, ConsoleApp) else ""
            raise AssertionError(f"timed out after {seconds}s waiting for {what}; screen:\n{seen}")
        await pilot.pause(0.1)
    await pilot.pause()


def table(app: ConsoleApp) -> TableView[Any]:
    view = app.view()
    assert isinstance(view, TableView)
    return view


def ready_ids(app: ConsoleApp) -> list[str]:
    rows = table(app).snapshot.replicas.values()
    return sorted(r.replica_id for r in rows if r.state is ShardState.READY)


async def confirm_shown(app: ConsoleApp, pilot: Pilot[Any]) -> str:
    """The confirmation is up with Cancel focused; its words, flattened."""
    await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the confirmation")
    assert isinstance(app.focused, Button) and app.focused.id == "cancel"
    return flat(app)


async def confirm(app: RecordingApp, pilot: Pilot[Any]) -> tuple[str, str, SeverityLevel]:
    """Move to the confirming button, press it, and wait for the outcome."""
    before = len(app.notes)
    await pilot.press("tab", "enter")
    await until(pilot, lambda: len(app.notes) > before, 15, "the outcome notification")
    assert not isinstance(app.screen, ConfirmScreen)
    return app.notes[-1]


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


pytestmark = [
    pytest.mark.timeout(300),  # a loaded machine: rollouts take longer
    # one worker, in file order: the fleet is the module's, and each test starts where the
    # one before it left it (--dist loadgroup split them, and a test found 2 replicas, not 1)
    pytest.mark.xdist_group("console_actions"),
]


async def test_d_drains_the_selected_replica_and_draining_it_again_is_refused(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 2, 60, "2 READY replicas on screen")
        victim = table(app).selected_key()
        assert victim in ready_ids(app)
        await pilot.press("d")
        text = await confirm_shown(app, pilot)
        assert f"Drain replica {victim}" in text
        assert f"replica {victim}: READY, deployment chat, profile chat-a, on a" in text
        assert f"{victim} serves 1 of 2 READY replicas of deployment chat; its in-flight " \
               "requests finish first." in text  # fmt: skip
        assert "Deployment chat scales down from 2 replicas to 1" in text
        title, message, severity = await confirm(app, pilot)
        assert (title, severity) == (f"Drain replica {victim}", "information")
        assert message == f"replica {victim} draining; deployment chat scaled down to 1 replica"
        await until(pilot, lambda: "▽ DRAINING" in line_of(app, victim), 15, "DRAINING shown")
        await pilot.press("space")  # paused at once: the row stays (selected) to be drained again
        deployments = await in_thread(fleet.get, "deployments")
        assert [d.get("replicas") for d in deployments] == [1]

        await pilot.press("d")
        assert f"{victim} is DRAINING: it serves no requests" in await confirm_shown(app, pilot)
        title, message, severity = await confirm(app, pilot)
        assert severity == "error" and title.startswith(f"Drain replica {victim}: refused (")
        assert message in (  # the server's words, by how far the retirement has got
            f"replica {victim} already draining",
            f"replica {victim} is retiring, not active",
            f"replica {victim} is retired, not active",
            f"no replica named '{victim}'",
        )
        await pilot.press("space", "6")  # the audit records arrive through Watch
        await until(pilot, lambda: "refused:" in line_of(app, "drain", f"replica/{victim}"),
                    15, "the refused drain in the events view")  # fmt: skip
        assert "ok: replica" in line_of(app, "audit", "drain", f"replica/{victim}", "ok:")
        assert line_of(app, "replica", victim, "READY → DRAINING")  # the change it saw
    events = await in_thread(fleet.events)
    assert any("drain" in e and f"replica/{victim}" in e and "ok: " in e for e in events)


async def test_s_starts_one_more_replica_of_the_selected_deployment(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 1, 60, "1 READY replica on screen")
        (kept,) = before = ready_ids(app)
        table(app).table.select_key(kept)
        await pilot.press("s")
        text = await confirm_shown(app, pilot)
        assert "Start a replica of deployment chat" in text
        assert "deployment chat: profile chat-a, model chat" in text
        assert "Deployment chat scales up from 1 replica to 2" in text
        title, message, severity = await confirm(app, pilot)
        assert (message, severity) == ("deployment chat scaled up to 2 replicas", "information")
        deployments = await in_thread(fleet.get, "deployments")
        assert [d.get("replicas") for d in deployments] == [2]
        await until(pilot, lambda: len(ready_ids(app)) == 2, 90, "the new replica READY")
        (new,) = set(ready_ids(app)) - set(before)
        assert "● READY" in line_of(app, new, "chat-a")


async def test_cancel_and_esc_send_nothing(fleet: Fleet, channel: GrpcWebChannel) -> None:
    events = await in_thread(fleet.operator_events)
    app = console(channel, fleet, "replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 2, 60, "2 READY replicas on screen")
        for verb, close in (("d", "enter"), ("d", "escape"), ("s", "enter")):
            await pilot.press(verb)
            await confirm_shown(app, pilot)
            await pilot.press(close)  # Enter on the focused Cancel; Esc
            assert app.screen is app.screen_stack[0]
        await pilot.pause(0.5)
        assert app.notes == [] and not list(app.workers)[1:]  # only the Watch worker
        assert len(ready_ids(app)) == 2
    assert await in_thread(fleet.operator_events) == events
    assert [d.get("replicas") for d in await in_thread(fleet.get, "deployments")] == [2]


async def test_p_reprofiles_the_deployment_to_a_profile_chosen_from_the_list(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 2, 60, "2 READY replicas on screen")
        old = ready_ids(app)
        await pilot.press("p")
        await until(pilot, lambda: isinstance(app.screen, ChoiceScreen), 10, "the profiles")
        text = flat(app)
        assert "Reprofile deployment chat" in text
        assert "● chat-a (in use): sim · 2×H100 · tp 2 · chat" in text
        assert "chat-b: sim · 2×H100 · tp 2 · chat · --max-model-len 4096" in text
        assert "phi" not in text and "Only profiles of the same model" in text
        listing = app.screen.query_one(OptionList)
        assert listing.highlighted == 0  # the one in use, highlighted
        await pilot.press("enter")  # the one in use cannot be chosen
        assert isinstance(app.screen, ChoiceScreen)
        await pilot.press("down", "enter")  # chat-b
        text = await confirm_shown(app, pilot)
        assert "deployment chat: profile chat-a → chat-b" in text
        assert f"replicas replaced: {', '.join(old)}" in text and "READY stays at 2" in text
        title, message, severity = await confirm(app, pilot)
        assert severity == "information" and message.startswith(
            "deployment chat reprofiled to chat-b"
        )
        assert [d.get("profile") for d in await in_thread(fleet.get, "deployments")] == ["chat-b"]
        await until(pilot, lambda: "↻old" in screen_text(app), 30, "old replicas marked")

        def rolled() -> bool:
            rows = table(app).snapshot.replicas.values()
            new = [r for r in rows if r.profile == "chat-b" and r.state is ShardState.READY]
            left = [r for r in rows if r.profile == "chat-a" and r.state is not ShardState.STOPPED]
            return len(new) == 2 and not left

        await until(pilot, rolled, 180, "both replicas replaced with chat-b")
        ready_lines = [line_of(app, r) for r in ready_ids(app)]
        assert len(ready_lines) == 2 and all("chat-b" in ln for ln in ready_lines)


async def test_capital_c_and_u_cordon_and_uncordon_the_selected_node(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "● READY" in line_of(app, " a2 ", "8×H100"), 30, "a2")
        table(app).table.select_key("n:a2")
        await pilot.press("C")
        text = await confirm_shown(app, pilot)
        assert "Cordon node a2" in text and "node a2: READY, 8×H100" in text
        assert "Nodes open for placement: 2 → 1 of 2." in text
        assert (await confirm(app, pilot))[1:] == ("node a2 cordoned", "information")
        await until(pilot, lambda: "⊘ CORDONED" in line_of(app, " a2 ", "8×H100"), 15, "⊘")
        cordoned = {n["info"]["nodeId"]: n.get("cordoned", False)
                    for n in await in_thread(fleet.get, "nodes")}  # fmt: skip
        assert cordoned == {"a1": False, "a2": True}

        await pilot.press("U")
        text = await confirm_shown(app, pilot)
        assert "Uncordon node a2" in text and "Nodes open for placement: 1 → 2 of 2." in text
        assert (await confirm(app, pilot))[1:] == ("node a2 uncordoned", "information")
        await until(pilot, lambda: "● READY" in line_of(app, " a2 ", "8×H100"), 15, "READY")
        assert not any(n.get("cordoned") for n in await in_thread(fleet.get, "nodes"))


async def test_capital_d_drains_a_node_and_its_replicas_move(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 2, 60, "2 READY replicas")
        snap = table(app).snapshot
        on_a1 = sorted(r.replica_id for r in snap.replicas.values() if "a1" in r.nodes)
        assert on_a1, "the spread put a replica on a1"
        gpu = next(k for k in snap.gpus if k.startswith("a1/"))
        table(app).table.select_key(f"g:{gpu}")
        await pilot.press("D")  # on a GPU row of a1: drains its node
        text = await confirm_shown(app, pilot)
        assert "Drain node a1" in text and f"replicas moving: {', '.join(on_a1)}" in text
        assert "its replacement starts and becomes READY before it drains" in text
        title, message, severity = await confirm(app, pilot)
        assert severity == "information"
        assert message == f"node a1 cordoned; replacing {', '.join(on_a1)} elsewhere, one at a time"
        await until(pilot, lambda: "⊘ CORDONED" in line_of(app, " a1 ", "8×H100"), 15, "⊘")

        def moved() -> bool:
            snap = table(app).snapshot
            ready = [r for r in snap.replicas.values() if r.state is ShardState.READY]
            on_a1 = [s for s in snap.shards.values() if s.node_id == "a1" and s.holds_gpus]
            return len(ready) == 2 and all(r.nodes == ("a2",) for r in ready) and not on_a1

        await until(pilot, moved, 180, "a1's replicas moved to a2")
        await pilot.press("3")
        assert all(" a2 " in line_of(app, r, "● READY") for r in ready_ids(app))
    shards = await in_thread(fleet.get, "shards")
    live = [s for s in shards if s["status"]["state"] != "SHARD_STATE_STOPPED"]
    assert {s["nodeId"] for s in live} == {"a2"}


async def test_read_only_shows_no_verb_and_its_client_refuses_a_forced_one(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    events = await in_thread(fleet.operator_events)
    app = console(channel, fleet, "replicas", read_only=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: len(ready_ids(app)) == 2, 60, "2 READY replicas on screen")
        for key in "dsp":
            await pilot.press(key)
            assert app.screen is app.screen_stack[0], key
        footer = screen_text(app).splitlines()[-1]
        assert "filter" in footer and not {"drain", "start", "reprofile"} & set(footer.split())
        app.action_drain()  # forced past check_action: the client refuses to send it
        await confirm_shown(app, pilot)
        title, message, severity = await confirm(app, pilot)
        assert (message, severity) == ("refused: this client is read-only", "error")
        assert title.endswith(": not sent")
    with pytest.raises(ClientError, match="read-only"):
        await ControlClient(channel, read_only=True).cordon_node("a1")
    assert await in_thread(fleet.operator_events) == events  # nothing reached the server


async def test_enter_on_a_replica_shows_its_recent_events_from_the_server(
    fleet: Fleet, channel: GrpcWebChannel
) -> None:
    app = console(channel, fleet, "replicas")
    async with app.run_test(size=(160, 50)) as pilot:  # room for the detail and its events
        await until(pilot, lambda: len(ready_ids(app)) >= 1, 60, "a READY replica on screen")
        chosen = table(app).selected_key()
        await pilot.press("enter")
        await until(pilot, lambda: "Recent events" in flat(app), 15, "the recent events")
        text = flat(app)
        placed = re.search(rf"reconciler .*placed (active|surge) replica {chosen} of", text)
        assert placed is not None, text  # placed as a replica, or as a roll's surge
