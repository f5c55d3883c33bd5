"""Helpers for the shard tests: send commands through the server's test hook, watch states."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from typing import Any

import httpx
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import ShardState, ShardStatus
from llmgw.client import ControlClient, GrpcWebChannel


class ShardWatch:
    """Every shard status the server publishes, from a Watch stream run in a thread."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[ShardStatus] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, name="shard-watch")

    def __enter__(self) -> ShardWatch:
        self._thread.start()
        assert self._started.wait(20), f"the Watch stream did not start: {self.error!r}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(20)

    def _run(self) -> None:
        self._task = self._loop.create_task(self._watch())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self.error = exc
        finally:
            self._started.set()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _watch(self) -> None:
        async with GrpcWebChannel(self.url) as channel:
            events = ControlClient(channel).watch()
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for event in events:
                    if event.snapshot is not None:
                        self._started.set()
                    elif event.shard is not None and event.shard.status is not None:
                        with self._lock:
                            self.seen.append(event.shard.status)

    def of(self, shard_id: str) -> list[ShardStatus]:
        with self._lock:
            return [s for s in self.seen if s.shard_id == shard_id]

    def states(self, shard_id: str) -> list[ShardState]:
        """The states of ``shard_id`` in order, repeats of one state folded."""
        states: list[ShardState] = []
        for status in self.of(shard_id):
            if not states or states[-1] is not status.state:
                states.append(status.state)
        return states

    def wait(
        self, shard_id: str, state: ShardState, *, nth: int = 1, within: float = 30
    ) -> ShardStatus:
        def found() -> ShardStatus | None:
            assert self.error is None, f"the Watch stream failed: {self.error!r}"
            hits = [s for s in self.of(shard_id) if s.state is state]
            return hits[nth - 1] if len(hits) >= nth else None

        what = f"{shard_id} {state.name} #{nth} (seen {[s.name for s in self.states(shard_id)]})"
        result: ShardStatus = wait_for(found, within, what, every=0.05)
        return result


def command(cluster: Cluster, node_id: str, body: dict[str, Any]) -> None:
    reply = httpx.post(f"{cluster.url}/debug/agents/{node_id}/command", json=body, timeout=10)
    assert reply.status_code == 200, reply.text


def listed_shards(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """``llmgw get shards -o json``, by shard id."""
    out = cluster.cli("get", "shards", "-o", "json")
    return {s["shardId"]: s for s in json.loads(out.stdout)["shards"]}
