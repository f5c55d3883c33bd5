"""The console's log pane: ``l`` on a replica or a shard follows its engine output.

Pilot tests with a stand-in client (what ``stream_logs`` was asked, that Esc closes the
stream, an ended stream saying why) and SVG snapshots of the pane at 80×24 and 160×50 over
the frozen cluster of ``test_console_snapshots``. The real RPC end to end is
``tests/integration/test_logs_e2e.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from grpclib.const import Status
from test_console_snapshots import LIVE, SIZES, FrozenFeed, SnapCompare, _frozen_environment, _shown
from textual.pilot import Pilot
from textual.widgets import Log

from llmgw.api.llmgw.v1 import LogLines
from llmgw.client import ControlClient, RpcError
from llmgw.tui.app import ConsoleApp
from llmgw.tui.widgets.logpane import TAIL, LogPane

__all__ = ["_frozen_environment"]  # the snapshot module's autouse fixture, used here too

ENGINE_OUTPUT = [
    "=== llmgw 2023-11-14T22:10:02+0000: shard big-1.0 (restart 0): vllm serve /models/chat "
    "--host 127.0.0.1 --port 20011 --served-model-name chat --tensor-parallel-size 2",
    "INFO 11-14 22:10:05 api_server.py:585] vLLM API server version 0.8.5",
    "INFO 11-14 22:10:41 gpu_model_runner.py:1329] Model loading took 14.99 GiB and 33.1 s",
    "INFO 11-14 22:10:52 kv_cache_utils.py:634] GPU KV cache size: 301,488 tokens",
    "INFO 11-14 22:10:53 launcher.py:28] Available routes are: /v1/completions, "
    "/v1/chat/completions, /v1/models, /tokenize, /metrics, /health",
    'INFO:     127.0.0.1:41236 - "GET /health HTTP/1.1" 200 OK',
    "INFO 11-14 22:13:02 logger.py:39] Received request cmpl-7f3a: prompt: 'Summarise the "
    "quarterly report in three bullet points', params: SamplingParams(max_tokens=256)",
    "WARNING 11-14 22:13:09 scheduler.py:1754] Sequence group cmpl-7f3a is preempted by "
    "PreemptionMode.RECOMPUTE\tbecause there is not enough KV cache space",
    "forged \x1b[2K\x1b[31mline\x07 with escapes",
]


class LogClient:
    """Stands in for ControlClient: one chunk of lines, then a wait (or ``end``)."""

    read_only = False

    def __init__(self, end: Exception | None = None) -> None:
        self.asked: list[tuple[str, bool, int | None]] = []
        self.closed = 0
        self.end = end

    def stream_logs(
        self, name: str, *, follow: bool = False, tail: int | None = None
    ) -> AsyncIterator[LogLines]:
        self.asked.append((name, follow, tail))
        return self._stream(name)

    async def _stream(self, name: str) -> AsyncIterator[LogLines]:
        try:
            shard = name if "." in name else f"{name}.0"
            yield LogLines(shard_id=shard, lines=ENGINE_OUTPUT)
            if self.end is not None:
                raise self.end
            await asyncio.Event().wait()
        finally:
            self.closed += 1


def _app(client: LogClient, view: str = "replicas") -> ConsoleApp:
    return ConsoleApp(
        FrozenFeed(LIVE),
        client=cast(ControlClient, client),
        server="http://127.0.0.1:8080",
        view=view,
        theme="textual-dark",
        clock=lambda: 500.0,
    )


async def _pane_open(pilot: Pilot[Any]) -> LogPane:
    await _shown(pilot)
    await pilot.press("l")
    for _ in range(100):
        screen = pilot.app.screen
        if isinstance(screen, LogPane) and screen.lines_shown:
            await pilot.pause()
            return screen
        await pilot.pause(0.05)
    raise AssertionError("the log pane never showed the engine output")


@pytest.mark.parametrize("view", ["replicas", "shards"])
async def test_l_follows_the_selected_row_and_esc_closes_the_stream(view: str) -> None:
    client = LogClient()
    app = _app(client, view)
    async with app.run_test(size=(100, 30)) as pilot:
        pane = await _pane_open(pilot)
        (asked,) = client.asked
        assert asked == (pane.target, True, TAIL)
        assert (pane.target.count(".") == 1) is (view == "shards")  # a shard id, or a replica
        shown = pane.query_one(Log).lines
        assert shown[1] == ENGINE_OUTPUT[1] and len(shown) == len(ENGINE_OUTPUT)
        assert shown[-1] == "forged \\x1b[2K\\x1b[31mline\\x07 with escapes"
        assert "\t" not in "".join(shown)
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, LogPane) and client.closed == 1


async def test_an_ended_stream_says_why_and_keeps_its_lines() -> None:
    client = LogClient(end=RpcError(Status.UNAVAILABLE, "node a1 disconnected"))
    async with _app(client).run_test(size=(100, 30)) as pilot:
        pane = await _pane_open(pilot)
        for _ in range(50):
            if pane.ended:
                break
            await pilot.pause(0.05)
        assert pane.ended == "the log stream ended: UNAVAILABLE: node a1 disconnected"
        assert len(pane.query_one(Log).lines) == len(ENGINE_OUTPUT)


async def test_l_elsewhere_opens_no_pane() -> None:
    client = LogClient()
    async with _app(client, "events").run_test(size=(100, 30)) as pilot:
        await _shown(pilot)
        await pilot.press("l")
        await pilot.pause()
        assert not isinstance(pilot.app.screen, LogPane) and client.asked == []


@pytest.mark.parametrize("size", SIZES)
def test_log_pane(snap_compare: SnapCompare, size: str) -> None:
    assert snap_compare(_app(LogClient()), terminal_size=SIZES[size], run_before=_pane_open)
