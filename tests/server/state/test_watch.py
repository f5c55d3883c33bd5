"""The watch fan-out: snapshot first, deltas in order, resync instead of unbounded memory."""

from __future__ import annotations

import asyncio

from llmgw.api.llmgw.v1 import Cluster, WatchEvent
from llmgw.server.state.watch import WatchHub


def _hub(max_queue: int = 8) -> WatchHub:
    return WatchHub(lambda rev: Cluster(revision=rev), max_queue=max_queue)


async def test_snapshot_then_deltas_in_order() -> None:
    hub = _hub()
    stream = aiter(hub.subscribe())
    first = await anext(stream)
    assert first.snapshot is not None and first.revision == 0
    hub.publish(WatchEvent(node_removed="a"))
    hub.publish(WatchEvent(node_removed="b"))
    got = [await anext(stream), await anext(stream)]
    assert [(e.revision, e.node_removed) for e in got] == [(1, "a"), (2, "b")]
    await stream.aclose()  # type: ignore[attr-defined]
    assert hub.watchers == 0


async def test_a_watcher_that_falls_behind_gets_a_fresh_snapshot() -> None:
    hub = _hub(max_queue=4)
    stream = aiter(hub.subscribe())
    await anext(stream)
    for i in range(10):
        hub.publish(WatchEvent(node_removed=str(i)))
    event = await anext(stream)
    assert event.snapshot is not None and event.snapshot.revision == 10
    assert hub.resyncs == 1
    hub.publish(WatchEvent(node_removed="next"))
    assert (await anext(stream)).node_removed == "next"
    await stream.aclose()  # type: ignore[attr-defined]


async def test_waiting_watcher_wakes_on_publish() -> None:
    hub = _hub()
    stream = aiter(hub.subscribe())
    await anext(stream)
    pending = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not pending.done()
    hub.publish(WatchEvent(node_removed="x"))
    assert (await asyncio.wait_for(pending, 1)).node_removed == "x"
    await stream.aclose()  # type: ignore[attr-defined]
