"""The console app through Textual's Pilot: a real server and a simulated agent (live, the
server killed and back), ``--once -o json``, and with a pushed feed: keyed updates that keep
selection and order, keys (``:``, ``space``, ``c``, Enter, hjkl), dimming while stale,
NO_COLOR, 16 colours and 80×24."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from textual import events
from textual.pilot import Pilot

from llmgw.addresses import free_port
from llmgw.api.llmgw.v1 import (
    Cluster,
    Gpu,
    GpuHealth,
    GpuTelemetry,
    Health,
    Node,
    NodeInfo,
    NodeState,
    NodeTelemetry,
    Replica,
    Shard,
    ShardState,
    ShardStatus,
    WatchEvent,
)
from llmgw.client import ControlClient, GrpcWebChannel
from llmgw.tui.app import ConsoleApp, pick_theme
from llmgw.tui.model import ClusterModel
from llmgw.tui.stream import Backoff, LinkPhase, LinkStatus, WatchConfig, WatchSession
from llmgw.tui.views.table import TableView
from llmgw.tui.widgets.badge import LinkBadge
from llmgw.tui.widgets.detail import DetailScreen

T0 = 1_700_000_000_000
GiB = 1 << 30


def screen_text(app: ConsoleApp) -> str:
    """What the terminal would show, as text (the compositor's lines; textual is pinned)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def painted_colours(app: ConsoleApp) -> set[Any]:
    """Every colour of the lines as the terminal gets them (the app's line filters applied)."""
    background = app.screen.styles.background
    colours = set()
    for strip in app.screen._compositor.render_strips():
        for line_filter in app.get_line_filters():
            strip = strip.apply_filter(line_filter, background)
        for segment in strip:
            style = segment.style
            colours |= (
                {c.get_truecolor() for c in (style.color, style.bgcolor) if c} if style else set()
            )
    return colours


def line_colours(app: ConsoleApp, text: str) -> list[tuple[int, int, int]]:
    """The foreground colours of the first screen line holding ``text``, distinct."""
    strips = app.screen._compositor.render_strips()
    strip = next(strip for strip in strips if text in strip.text)
    seen: list[tuple[int, int, int]] = []
    for segment in strip:
        colour = segment.style.color if segment.style else None
        if colour is not None:
            red, green, blue = colour.get_truecolor()
            if (red, green, blue) not in seen:
                seen.append((red, green, blue))
    return seen


def badge(app: ConsoleApp) -> str:
    return app.query_one(LinkBadge).text


async def until(pilot: Pilot[Any], check: Callable[[], object], seconds: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        await pilot.pause(0.1)
    await pilot.pause()  # and drawn


# --- a pushed feed -------------------------------------------------------------------------


class PushFeed:
    """A feed the test drives: snapshots from a ClusterModel, statuses by hand."""

    def __init__(self) -> None:
        self.model = ClusterModel()
        self.sink: Any = None
        self.now = T0

    async def run(self, sink: Any) -> None:
        self.sink = sink
        await asyncio.Event().wait()

    def apply(self, *events: WatchEvent) -> None:
        for event in events:
            self.model.apply(event, self.now)
        self.now += 1000
        self.sink.snapshot_ready(self.model.snapshot(self.now))

    def status(self, status: LinkStatus) -> None:
        self.sink.status_changed(status)


def gpu(node: str, i: int) -> Gpu:
    return Gpu(
        index=i,
        uuid=f"GPU-{node}-{i}",
        name="NVIDIA H100 80GB HBM3",
        gpu_class="H100",
        memory_total_bytes=80 * GiB,
        numa_node=i // 2,
        nvlink_peers=[j for j in range(4) if j != i],
        health=GpuHealth(health=Health.HEALTHY, temperature_c=40 + i),
    )


def node(node_id: str, state: NodeState = NodeState.READY) -> Node:
    info = NodeInfo(node_id=node_id, hostname=node_id, gpus=[gpu(node_id, i) for i in range(4)])
    return Node(info=info, state=state, connected=True)


def beat(node_id: str, utils: dict[int, int]) -> WatchEvent:
    gpus = [
        GpuTelemetry(
            uuid=f"GPU-{node_id}-{i}",
            utilization_pct=u,
            temperature_c=40 + i,
            health=Health.HEALTHY,
        )
        for i, u in utils.items()
    ]
    return WatchEvent(node_telemetry=NodeTelemetry(node_id=node_id, gpus=gpus))


def small_cluster() -> Cluster:
    status = ShardStatus(
        shard_id="chat-1.0", replica_id="chat-1", state=ShardState.READY,
        gpu_uuids=["GPU-a1-0", "GPU-a1-1"], since_unix_ms=T0 - 90_000,
    )  # fmt: skip
    return Cluster(
        nodes=[node("a1"), node("a2")],
        shards=[Shard(shard_id="chat-1.0", replica_id="chat-1", node_id="a1", status=status)],
        replicas=[
            Replica(replica_id="chat-1", deployment="chat", profile="chat-a", model="chat",
                    state=ShardState.READY, shard_ids=["chat-1.0"]),
            Replica(replica_id="chat-2", deployment="chat", profile="chat-a", model="chat",
                    state=ShardState.FAILED, out_of_date=True),
        ],
    )  # fmt: skip


LIVE = LinkStatus().to(LinkPhase.LIVE, live_at=100.0)


async def started(app: ConsoleApp, pilot: Pilot[Any], feed: PushFeed) -> None:
    await until(pilot, lambda: feed.sink is not None, 5, "the feed to start")
    feed.status(LIVE)
    feed.apply(WatchEvent(revision=1, snapshot=small_cluster()))
    await pilot.pause()


class Calls:
    """Counts the DataTable calls a view makes, and the rows or cells the batched ones carry."""

    BATCHED: ClassVar = {"append_rows": "added", "remove_rows": "removed", "update_cells": "cells"}

    def __init__(self, table: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: dict[str, int] = {}
        self.items = dict.fromkeys(self.BATCHED.values(), 0)
        for name in (*self.BATCHED, "add_row", "remove_row", "update_cell", "clear", "sort"):
            monkeypatch.setattr(table, name, self._counting(name, getattr(table, name)))

    def _counting(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] = self.counts.get(name, 0) + 1
            if name in self.BATCHED:
                batch = list(args[0])
                self.items[self.BATCHED[name]] += len(batch)
                args = (batch,)
            return method(*args, **kwargs)

        return call


# --- keyed updates -------------------------------------------------------------------------


async def test_updates_are_keyed_diffs_that_keep_the_selection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes", clock=lambda: 100.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        view = app.view()
        assert isinstance(view, TableView)
        assert view.shown_keys()[:3] == ["n:a1", "g:a1/GPU-a1-0", "g:a1/GPU-a1-1"]
        await pilot.press("j", "j", "j")  # a1, GPU 0, GPU 1, GPU 2
        assert view.selected_key() == "g:a1/GPU-a1-2"
        calls = Calls(view.table, monkeypatch)
        feed.apply(beat("a1", {2: 91, 3: 55}), WatchEvent(node=node("a0")))  # a0 sorts first
        await pilot.pause()
        assert calls.counts == {"append_rows": 1, "remove_rows": 1, "update_cells": 1}
        assert calls.items == {"added": 5, "removed": 0, "cells": 2}  # a0 + 4 GPUs; 2 UTIL
        assert view.selected_key() == "g:a1/GPU-a1-2"  # moved down 5 rows, still selected
        assert view.shown_keys()[:2] == ["n:a0", "g:a0/GPU-a0-0"]
        assert "91%" in screen_text(app)
        feed.apply(WatchEvent(node_removed="a0"))
        await pilot.pause()
        assert calls.items["removed"] == 5
        assert not {"clear", "sort", "add_row", "remove_row", "update_cell"} & set(calls.counts)
        assert view.selected_key() == "g:a1/GPU-a1-2"
        assert not any(k.startswith(("n:a0", "g:a0/")) for k in view.shown_keys())


async def test_a_chosen_order_survives_updates() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes", clock=lambda: 100.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        view = app.view()
        assert isinstance(view, TableView)
        view.sort_by("util", reverse=True)
        feed.apply(beat("a2", {0: 10, 1: 80, 2: 30, 3: 0}), beat("a1", {3: 50}))
        await pilot.pause()
        gpus = [k for k in view.shown_keys() if k.startswith("g:")]
        assert gpus[:3] == ["g:a2/GPU-a2-1", "g:a1/GPU-a1-3", "g:a2/GPU-a2-2"]
        feed.apply(beat("a2", {0: 99}))
        await pilot.pause()
        assert [k for k in view.shown_keys() if k.startswith("g:")][0] == "g:a2/GPU-a2-0"
        await pilot.press("o")  # cycles on to the next order: still a sort, kept
        assert view.describe_sort() == "Nodes: by MEM ▲"


# --- keys --------------------------------------------------------------------------------


async def test_colon_jumps_to_views_by_name_alias_and_prefix() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        jumps = [("replicas", "replicas"), ("topology", "nodes"), ("ev", "events"),
                 ("sh", "shards"), ("router", "router"), ("overview", "overview")]  # fmt: skip
        for typed, view in jumps:
            await pilot.press("colon", *typed, "enter")
            assert app.current_view == view, typed
        await pilot.press("colon", *"nowhere", "enter")
        assert app.current_view == "overview"
        await pilot.press("colon", "n", "escape")
        assert app.current_view == "overview" and app.focused is None
        await pilot.press("3")
        assert app.current_view == "replicas"
        assert "chat-1" in screen_text(app) and "✗ FAILED" in screen_text(app)
        for key, char in [("colon", ":"), *((c, c) for c in "nodes"), ("enter", "\r")]:
            app.post_message(events.Key(key, char))  # a burst, as over ssh or from a paste
        await pilot.pause()
        assert app.current_view == "nodes"


async def test_c_copies_the_selected_id_and_enter_opens_the_detail() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        await pilot.press("j", "c")
        assert app.clipboard == "GPU-a1-0"
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        text = screen_text(app)
        assert "NVLink peers" in text and "1-3" in text and "chat-1.0" in text
        feed.apply(beat("a1", {0: 77}))  # updates and link changes go on under the detail
        feed.status(LIVE.to(LinkPhase.STALE, live_at=100.0))
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen) and badge(app).startswith("STALE")
        feed.status(LinkStatus(LinkPhase.RECONNECTING, 1).to(LinkPhase.LIVE, live_at=100.0))
        await pilot.press("escape", "k", "c")
        assert not isinstance(app.screen, DetailScreen) and app.clipboard == "a1"
        await pilot.press("colon", *"replicas", "enter", "G", "c")
        assert app.clipboard == "chat-2"
        await pilot.press("enter")
        assert "out of date" in screen_text(app)


async def test_space_pauses_updates_and_resuming_shows_the_latest() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas", clock=lambda: 100.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        await pilot.press("space")
        assert badge(app) == "LIVE · PAUSED"
        feed.apply(WatchEvent(replica_removed="chat-2"))
        await pilot.pause()
        view = app.view()
        assert isinstance(view, TableView)
        assert "chat-2" in view.shown_keys()
        await pilot.press("colon", *"shards", "enter", "colon", *"replicas", "enter")
        assert "chat-2" in view.shown_keys()  # still the paused picture
        await pilot.press("space")
        assert view.shown_keys() == ["chat-1"] and badge(app) == "LIVE"


# --- the link ------------------------------------------------------------------------------


async def test_badge_and_dimming_follow_the_link() -> None:
    feed = PushFeed()
    now = [100.0]
    app = ConsoleApp(feed, view="nodes", clock=lambda: now[0], theme="textual-dark")
    async with app.run_test(size=(80, 24)) as pilot:
        views = app.query_one("#views")
        assert badge(app) == "CONNECTING" and views.has_class("-stale")
        await started(app, pilot, feed)
        assert badge(app) == "LIVE" and not views.has_class("-stale")
        bright = line_colours(app, "✓ ok")  # GPU 0 of a1: util bar, health glyph, text
        stale = LIVE.to(LinkPhase.STALE, error="connection lost", live_at=100.0)
        feed.status(stale)
        await pilot.pause()
        dim = line_colours(app, "✓ ok")
        assert len(dim) == len(bright) and sum(map(sum, dim)) < 0.75 * sum(map(sum, bright))
        now[0] = 112.0
        await pilot.pause(1.2)  # the badge's clock ticks every second
        assert badge(app) == "STALE 12s" and views.has_class("-stale")
        assert "a1" in screen_text(app)  # the data stay, dimmed
        assert screen_text(app).splitlines()[1].strip() == "connection lost"  # and why
        feed.status(stale.to(LinkPhase.RECONNECTING, attempt=3))
        await pilot.pause()
        assert badge(app) == "RECONNECTING #3" and "RECONNECTING #3" in screen_text(app)
        feed.status(LinkStatus(LinkPhase.RECONNECTING, 3).to(LinkPhase.LIVE, live_at=now[0]))
        await pilot.pause()
        assert badge(app) == "LIVE" and not views.has_class("-stale")


# --- terminals ---------------------------------------------------------------------------


async def test_no_color_at_80x24_keeps_glyphs_and_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes", theme="textual-dark")  # full colour, but NO_COLOR
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        assert app.no_color
        text = screen_text(app)
        lines = text.splitlines()
        assert len(lines) == 24 and all(len(line) == 80 for line in lines)
        for word in ("NODE", "GPU", "UTIL", "MEM", "HEALTH", "SHARD", "● READY", "✓ ok", "LIVE"):
            assert word in text, word
        await pilot.press("colon", *"replicas", "enter")
        assert "● READY" in screen_text(app) and "✗ FAILED" in screen_text(app)
        greys = [c.red == c.green == c.blue for c in painted_colours(app)]
        assert greys and all(greys)  # what reaches the terminal has no hue at all


def test_sixteen_colour_terminals_get_the_ansi_theme() -> None:
    assert pick_theme({"TERM": "xterm"}) == "ansi-dark"
    assert pick_theme({"TERM": "screen"}) == "ansi-dark"
    assert pick_theme({"TERM": "xterm-256color"}) == "textual-dark"
    assert pick_theme({"TERM": "xterm", "COLORTERM": "truecolor"}) == "textual-dark"


async def test_the_ansi_theme_renders_every_view() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, theme="ansi-dark")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        for key, word in zip("123456", ("nodes", "NODE", "REPLICA", "SHARD", "reuse", "TIME"),
                             strict=True):  # fmt: skip
            await pilot.press(key)
            assert word in screen_text(app)


# --- a real server -------------------------------------------------------------------------


class Procs:
    """``llmgw server`` and ``llmgw agent --simulate`` as subprocesses on loopback."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.grpc, self.http = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def spawn(self, name: str, *args: str) -> None:
        with (self.root / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "llmgw", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    async def start_server(self) -> None:
        self.spawn(
            "server", "server", "--grpc-listen", f"127.0.0.1:{self.grpc}", "--http-listen",
            f"127.0.0.1:{self.http}", "--gateway-listen", "off", "--db",
            str(self.root / "server.db"), "--node-grace", "3",
        )  # fmt: skip
        async with httpx.AsyncClient() as http, asyncio.timeout(30):
            while True:
                try:
                    if (await http.get(f"{self.url}/healthz", timeout=1)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)

    def start_agent(self, node_id: str, fixture: str) -> None:
        self.spawn(
            node_id, "agent", "--server", f"127.0.0.1:{self.grpc}", "--node-id", node_id,
            "--simulate", fixture, "--state-dir", str(self.root / node_id),
        )  # fmt: skip

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.procs.clear()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
async def channel(procs: Procs) -> AsyncIterator[GrpcWebChannel]:
    async with GrpcWebChannel(procs.url) as ch:
        yield ch


QUICK = WatchConfig(backoff=Backoff(first_s=0.2, max_s=1.0), idle_s=5.0, frame_s=0.1)


@pytest.mark.timeout(120)
async def test_a_real_server_its_outage_and_its_return(
    procs: Procs, channel: GrpcWebChannel
) -> None:
    await procs.start_server()
    procs.start_agent("a1", "dgx-h100")
    client = ControlClient(channel)
    app = ConsoleApp(WatchSession(client, QUICK), client=client, server=procs.url, view="nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        view = app.view()
        assert isinstance(view, TableView)

        def a1_ready() -> bool:
            row = view.snapshot.nodes.get("a1")
            return row is not None and row.state is NodeState.READY

        await until(pilot, a1_ready, 40, "the simulated agent's node READY")
        gpu_rows = [k for k in view.shown_keys() if k.startswith("g:a1/")]
        assert len(gpu_rows) == 8 and badge(app) == "LIVE"
        text = screen_text(app)
        assert "8×H100" in text and "● READY" in text and "✓ ok" in text

        procs.kill("server")
        await until(pilot, lambda: badge(app).startswith(("STALE", "RECONNECTING")), 15, "stale")
        assert app.query_one("#views").has_class("-stale")
        assert "8×H100" in screen_text(app)  # the last data stay on screen
        await until(pilot, lambda: app.status.attempt >= 2, 15, "two reconnection attempts")
        assert badge(app).startswith(("STALE", "RECONNECTING"))
        text = screen_text(app)
        assert "8×H100" in text and ("STALE" in text or "RECONNECTING" in text)

        await procs.start_server()  # same ports, same database: the app was never restarted
        await until(pilot, lambda: badge(app) == "LIVE", 30, "LIVE again")
        assert not app.query_one("#views").has_class("-stale")
        await until(pilot, a1_ready, 40, "the agent back on the new server")
        assert len([k for k in view.shown_keys() if k.startswith("g:a1/")]) == 8


@pytest.mark.timeout(120)
async def test_once_json_prints_the_cluster(procs: Procs, channel: GrpcWebChannel) -> None:
    await procs.start_server()
    procs.start_agent("m1", "a100-mig")
    client = ControlClient(channel)
    for _ in range(200):  # the agent registers within seconds
        if (await client.get_cluster()).nodes:
            break
        await asyncio.sleep(0.2)
    args = ["-m", "llmgw", "console", "--server", procs.url, "--once", "-o", "json"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    data = json.loads(out)
    assert data["server"] == procs.url and data["overview"]["nodesTotal"] == 1
    assert [n["nodeId"] for n in data["nodes"]] == ["m1"]
    migs = [g for g in data["gpus"] if g["info"]["migProfile"]]
    assert migs and all(g["nodeId"] == "m1" for g in data["gpus"])
    assert data["router"]["status"] == "UNAVAILABLE"
    assert "runs no gateway" in data["router"]["reason"]


def test_the_token_goes_as_a_bearer_header_and_unreachable_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import llmgw.cli.console as console_cli
    from llmgw.cli.main import main
    from llmgw.client import ServerUnreachable

    seen: list[object] = []

    class Channel:
        def __init__(self, url: str, *, headers: dict[str, str] | None = None) -> None:
            seen.append(headers)

        async def __aenter__(self) -> Channel:
            raise ServerUnreachable("http://nowhere:1", "cannot connect (refused)")

        async def __aexit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(console_cli, "GrpcWebChannel", Channel)
    code = main(["console", "--server", "http://nowhere:1", "--token", "s3cret", "--once"])
    assert code == 1 and seen == [{"authorization": "Bearer s3cret"}]
    assert capsys.readouterr().err.startswith("llmgw: cannot reach the control server at")


async def test_read_only_hides_mutating_actions_and_views_scope_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmgw.tui import app as app_module
    from llmgw.tui.registry import ConsoleAction, action_named

    drain = ConsoleAction(
        "drain", "d", "drain", "operate", mutating=True, views=frozenset({"replicas"})
    )

    def named(name: str) -> ConsoleAction | None:
        return drain if name == "drain" else action_named(name)

    monkeypatch.setattr(app_module, "action_named", named)
    for read_only, expected in ((False, True), (True, False)):
        feed = PushFeed()
        app = ConsoleApp(feed, view="replicas", read_only=read_only)
        async with app.run_test(size=(80, 24)) as pilot:
            await started(app, pilot, feed)
            assert app.check_action("drain", ()) is expected
            await pilot.press("1")
            assert app.check_action("drain", ()) is False  # not a verb of the overview
            assert app.check_action("copy_id", ()) is False and app.check_action("pause", ())


async def test_control_characters_from_the_wire_are_shown_escaped_never_sent() -> None:
    forged = "a0\n\x1b[2Knode-forged  READY"
    hostile = Node(
        info=NodeInfo(
            node_id="a0",
            hostname=forged,
            labels={"zone": forged},
            discovery="nvml\x1b]52;c;cHduZWQ=\x07",  # OSC 52: would write the clipboard
        ),
        state=NodeState.READY,
        connected=True,
    )
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes")
    async with app.run_test(size=(100, 30)) as pilot:
        await started(app, pilot, feed)
        feed.apply(WatchEvent(node=hostile))
        await pilot.pause()
        await pilot.press("k", "c")
        assert app.clipboard == "a0"
        await pilot.press("enter")
        assert isinstance(app.screen, DetailScreen)
        text = screen_text(app)
        assert "a0\\n\\x1b[2Knode-forged  READY" in text
        assert "nvml\\x1b]52;c;cHduZWQ=\\x07" in text
        painted = [s.text for strip in app.screen._compositor.render_strips() for s in strip]
        assert not any(c in t for t in painted for c in "\x1b\x07\n")
