"""The console's habits through Pilot, with a pushed feed: ``/`` filters (``!`` inverts, Esc
clears, the filter survives updates and stays per view), ``?`` help lists every key of the
view, ctrl+p runs the registry's actions, Esc closes what is open, arrows and hjkl move,
the confirmation plans against the whole model and not the filtered rows, and read-only
leaves no verb in the footer, the help or the palette."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Button

from llmgw.api.llmgw.v1 import (
    Cluster,
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
from llmgw.tui.app import ConsoleApp
from llmgw.tui.filter import RowFilter, RowTexts, parse_filter
from llmgw.tui.help import HelpScreen, key_words
from llmgw.tui.modals import ConfirmScreen
from llmgw.tui.model import ClusterModel
from llmgw.tui.registry import ACTIONS, bindings
from llmgw.tui.stream import LinkPhase, LinkStatus
from llmgw.tui.views.table import TableView
from llmgw.tui.widgets.detail import DetailScreen

T0 = 1_700_000_000_000
GiB = 1 << 30
LIVE = LinkStatus().to(LinkPhase.LIVE, live_at=100.0)


def screen_text(app: ConsoleApp) -> str:
    """What the terminal would show, as text (the compositor's lines; textual is pinned)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def flat(app: ConsoleApp) -> str:
    """The screen's words with box lines and wrapping gone: sentences read across lines."""
    text = screen_text(app)
    for char in "│╭╮╰╯─▊▎▔▁":
        text = text.replace(char, " ")
    return " ".join(text.split())


def footer(app: ConsoleApp) -> str:
    return screen_text(app).splitlines()[-1]


async def until(pilot: Pilot[Any], check: Callable[[], object], seconds: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        await pilot.pause(0.05)
    await pilot.pause()


class PushFeed:
    """A feed the test drives: snapshots from a ClusterModel."""

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


def node(node_id: str, gpus: int = 4) -> Node:
    devices = [
        Gpu(index=i, uuid=f"GPU-{node_id}-{i}", gpu_class="H100", memory_total_bytes=80 * GiB,
            numa_node=0, health=GpuHealth(health=Health.HEALTHY))
        for i in range(gpus)
    ]  # fmt: skip
    info = NodeInfo(node_id=node_id, hostname=node_id, gpus=devices)
    return Node(info=info, state=NodeState.READY, connected=True)


def shard(replica: str, node_id: str, gpus: tuple[int, ...]) -> Shard:
    status = ShardStatus(
        shard_id=f"{replica}.0", replica_id=replica, state=ShardState.READY,
        gpu_uuids=[f"GPU-{node_id}-{i}" for i in gpus], since_unix_ms=T0 - 60_000,
    )  # fmt: skip
    return Shard(shard_id=f"{replica}.0", replica_id=replica, node_id=node_id, status=status)


def replica(replica_id: str, state: ShardState = ShardState.READY) -> Replica:
    return Replica(replica_id=replica_id, deployment="chat", profile="chat-a", model="chat",
                   state=state, shard_ids=[f"{replica_id}.0"])  # fmt: skip


def cluster() -> Cluster:
    """chat-1 on a1, chat-3 on a2 (both READY), chat-2 FAILED nowhere."""
    return Cluster(
        nodes=[node("a1"), node("a2")],
        shards=[shard("chat-1", "a1", (0, 1)), shard("chat-3", "a2", (0, 1))],
        replicas=[replica("chat-1"), replica("chat-2", ShardState.FAILED), replica("chat-3")],
    )


async def started(app: ConsoleApp, pilot: Pilot[Any], feed: PushFeed) -> None:
    await until(pilot, lambda: feed.sink is not None, 5, "the feed to start")
    feed.sink.status_changed(LIVE)
    feed.apply(WatchEvent(revision=1, snapshot=cluster()))
    await pilot.pause()


def table_view(app: ConsoleApp) -> TableView[Any]:
    view = app.view()
    assert isinstance(view, TableView)
    return view


# --- the filter, pure ----------------------------------------------------------------------


def test_parse_filter_reads_substring_and_inversion() -> None:
    assert parse_filter("chat") == RowFilter("chat")
    assert parse_filter("  READY ") == RowFilter("ready")
    assert parse_filter("!a2") == RowFilter("a2", inverted=True)
    assert parse_filter("! a2").text == "!a2"  # type: ignore[union-attr]
    assert parse_filter("") is None and parse_filter("!") is None and parse_filter("  ") is None
    ready = RowFilter("ready")
    assert ready.matches("chat-1 ● READY a1") and not ready.matches("chat-2 ✗ FAILED")
    assert RowFilter("ready", inverted=True).matches("chat-2 ✗ FAILED")


def test_row_texts_are_computed_once_per_row_object() -> None:
    texts, calls = RowTexts(), []

    def compute(word: str) -> Callable[[], str]:
        def text() -> str:
            calls.append(word)
            return word

        return text

    a, b = ("a",), ("b",)
    assert texts.text(a, compute("A")) == "A" and texts.text(b, compute("B")) == "B"
    texts.next_pass()
    assert texts.text(a, compute("again")) == "A"  # same object: cached
    texts.next_pass()  # b was not asked for in the last pass: dropped
    assert texts.text(b, compute("B2")) == "B2" and len(texts) == 1
    assert calls == ["A", "B", "B2"]


# --- the filter, on screen -----------------------------------------------------------------


async def test_slash_filters_as_typed_bang_inverts_and_esc_clears() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        view = table_view(app)
        everything = view.shown_keys()
        assert len(everything) == 10  # two nodes, four GPUs each
        await pilot.press("slash", "a", "2")
        assert view.shown_keys() == [k for k in everything if "a2" in k]  # while typing
        await pilot.press("enter")
        assert app.focused is view.table and "/a2" in screen_text(app).splitlines()[0]
        feed.apply(WatchEvent(node=node("a3")), WatchEvent(node=node("a20", 1)))
        await pilot.pause()  # the filter holds for what arrives later
        assert view.shown_keys() == [k for k in view.shown_keys() if "a2" in k]
        assert "n:a20" in view.shown_keys() and "n:a3" not in view.shown_keys()
        await pilot.press("slash", "backspace", "backspace", *"!a2", "enter")
        assert view.shown_keys() == ["n:a1", *(f"g:a1/GPU-a1-{i}" for i in range(4)),
                                     "n:a3", *(f"g:a3/GPU-a3-{i}" for i in range(4))]  # fmt: skip
        await pilot.press("escape")  # Esc on the view clears its filter
        assert len(view.shown_keys()) == 10 + 5 + 2 and "/" not in screen_text(app).splitlines()[0]
        await pilot.press("slash", *"ready")  # the text on screen: node state words
        assert view.shown_keys() == ["n:a1", "n:a2", "n:a20", "n:a3"]
        await pilot.press("escape")  # Esc in the prompt clears it too, and closes it
        assert len(view.shown_keys()) == 17 and app.focused is view.table


async def test_each_view_keeps_its_own_filter_and_events_are_filterable() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        await pilot.press("slash", *"failed", "enter")
        assert table_view(app).shown_keys() == ["chat-2"]
        feed.apply(WatchEvent(replica=replica("chat-3", ShardState.DRAINING)))
        await pilot.press("6", "slash", *"drain", "enter")
        events = table_view(app)
        assert len(events.shown_keys()) == 1 and "READY → DRAINING" in screen_text(app)
        await pilot.press("3")
        assert table_view(app).shown_keys() == ["chat-2"] and "/failed" in screen_text(app)


async def test_the_confirmation_counts_the_whole_model_not_the_filtered_rows() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        await pilot.press("slash", *"chat-1", "enter")
        assert table_view(app).shown_keys() == ["chat-1"]
        await pilot.press("d")
        assert isinstance(app.screen, ConfirmScreen)
        text = flat(app)
        assert "Drain replica chat-1" in text
        assert "chat-1 serves 1 of 2 READY replicas of deployment chat" in text  # chat-3 too
        assert "Deployment chat scales down from 3 replicas to 2" in text
        assert "Frees 2 GPUs on a1" in text
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"
        await pilot.press("escape")
        await pilot.press("2", "slash", *"a2", "enter")  # a1's rows are filtered out
        view = table_view(app)
        view.table.select_key("g:a2/GPU-a2-1")  # a GPU row acts on its node
        await pilot.press("D")
        text = flat(app)
        assert "Drain node a2" in text and "replicas moving: chat-3" in text
        # No server to ask (this console has no client): no guess at room elsewhere.
        assert "Where they would go is not known (this console has no connection" in text
        assert "free GPU" not in text


# --- help --------------------------------------------------------------------------------


def _help_lines(app: ConsoleApp) -> set[tuple[str, str]]:
    screen = app.screen
    assert isinstance(screen, HelpScreen)
    return {line for section in screen.sections for line in section.lines}


async def test_question_mark_lists_every_binding_of_each_view() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="overview")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        for key in "123456":
            await pilot.press(key, "question_mark")
            lines = _help_lines(app)
            expected = {(key_words(a), a.description) for a in ACTIONS
                        if a.keys and app.action_allowed(a)}  # fmt: skip
            assert lines == expected, app.current_view
            # … and every key the app would act on here (Textual's own list) is in it
            bound = {
                key
                for key, b in app.screen_stack[0].active_bindings.items()
                if b.node is app and b.enabled and not b.binding.system
            }
            helped = {k for a in ACTIONS if a.keys and app.action_allowed(a)
                      for k in a.keys.split(",")}  # fmt: skip
            assert bound <= helped, (app.current_view, bound - helped)
            text = screen_text(app)
            for keys, words in lines:  # on screen at 80×24, nothing scrolled away
                assert any(keys in line and words in line for line in text.splitlines()), words
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
        await pilot.press("3", "question_mark")
        text = screen_text(app)
        assert "Keys: Replicas" in text and "operate" in text and "reprofile" in text
        assert ("d", "drain") in _help_lines(app) and ("j ↓", "down") in _help_lines(app)
        await pilot.press("question_mark")  # ? closes it as well
        await pilot.press("2", "question_mark")
        assert {("C", "cordon"), ("U", "uncordon"), ("D", "drain node")} <= _help_lines(app)
        assert ("d", "drain") not in _help_lines(app)  # not a verb of the nodes view


# --- the palette -----------------------------------------------------------------------------


async def test_ctrl_p_palette_offers_the_registry_and_runs_an_action() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="nodes")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        await pilot.press("ctrl+p")
        await pilot.pause(0.3)
        text = screen_text(app)
        assert "go to replicas" in text and "cordon" in text
        await pilot.press(*"go to replicas")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, lambda: app.current_view == "replicas", 5, "the palette's goto")
        await pilot.press("ctrl+p", *"start a replica of deployment chat")
        await pilot.pause(0.3)
        assert "start a replica of deployment chat" in screen_text(app)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 5, "the confirmation")
        assert "Start a replica of deployment chat" in flat(app)
        assert "from 3 replicas to 4" in flat(app)
        assert isinstance(app.focused, Button) and app.focused.id == "cancel"
        await pilot.press("enter")  # Cancel
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("ctrl+p", *"filter")
        await pilot.pause(0.3)
        await pilot.press("enter")  # the palette's filter opens the same prompt
        await until(pilot, lambda: app.focused is app.query_one("#filter"), 5, "the prompt")
        await pilot.press(*"failed")
        assert table_view(app).shown_keys() == ["chat-2"]


# --- Esc, arrows, hjkl, modals ----------------------------------------------------------------


async def test_esc_closes_detail_confirmation_and_help_and_keys_stay_under_modals() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        view = table_view(app)
        await pilot.press("down")  # arrows move the cursor as j/k do
        assert view.selected_key() == "chat-2"
        await pilot.press("k", "j", "j")
        assert view.selected_key() == "chat-3"
        for key, screen in (("enter", DetailScreen), ("d", ConfirmScreen),
                            ("question_mark", HelpScreen)):  # fmt: skip
            await pilot.press(key)
            assert isinstance(app.screen, screen)
            await pilot.press("colon", "1")  # neither opens the prompt nor switches views
            assert isinstance(app.screen, screen) and app.current_view == "replicas"
            await pilot.press("escape")
            assert app.screen is app.screen_stack[0]
        assert app.current_view == "replicas" and app.focused is view.table


async def test_verbs_belong_to_their_views_and_every_key_is_bound_once() -> None:
    keys = [k for b in bindings() for k in b.key.split(",")]
    assert len(keys) == len(set(keys))
    verbs = {a.name: a for a in ACTIONS if a.mutating}
    assert set(verbs) == {"drain", "start", "reprofile", "start_deployment", "cordon",
                          "uncordon", "drain_node"}  # fmt: skip
    assert all(a.group == "operate" for a in verbs.values())
    assert verbs["drain"].views == verbs["reprofile"].views == {"replicas", "shards"}
    assert verbs["cordon"].views == verbs["drain_node"].views == {"nodes"}
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas")
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        assert "d drain" in footer(app) and "cordon" not in footer(app)
        await pilot.press("2")
        assert "C cordon" in footer(app) and "d drain" not in footer(app)
        await pilot.press("d")  # not a verb here: nothing opens
        assert app.screen is app.screen_stack[0]


async def test_read_only_leaves_no_verb_in_footer_help_or_palette() -> None:
    feed = PushFeed()
    app = ConsoleApp(feed, view="replicas", read_only=True)
    async with app.run_test(size=(80, 24)) as pilot:
        await started(app, pilot, feed)
        for view_key, verbs in (("3", "dsp"), ("4", "dsp"), ("2", "CUD")):
            await pilot.press(view_key)
            for verb in verbs:
                await pilot.press(verb)
                assert app.screen is app.screen_stack[0], verb
            text = footer(app)
            assert "/ filter" in text
            assert not any(w in text for w in ("drain", "start", "reprofile", "cordon"))
            await pilot.press("question_mark")
            words = {w for _, w in _help_lines(app)}
            assert "filter" in words and not words & {
                "drain",
                "start",
                "reprofile",
                "cordon",
                "uncordon",
                "drain node",
            }
            await pilot.press("escape", "ctrl+p")
            await pilot.pause(0.3)
            text = screen_text(app)
            assert "go to replicas" in text
            assert not any(w in text for w in ("drain", "start a replica", "reprofile", "cordon"))
            await pilot.press(*"drain")
            await pilot.pause(0.3)
            assert "drain" not in screen_text(app).replace("🔎 drain", "")
            await pilot.press("escape")
