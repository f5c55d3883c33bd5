"""Shared setup of the precise-tier end-to-end tests: a server with its in-server gateway, a
simulated DGX agent and ``llmgw sim-engine`` replicas publishing KV events over ``ipc://``.

What the tests read: the gateway's ``/metrics`` (`metrics`), each engine's own cache
(``GET /debug/kv_cache``: llmgw block keys, `engine_keys`) and its KV event test hooks
(``--sim-test-hooks``: ``/sim/kv_events``), and a second gateway's KV index built by the
product's own feed client (`FeedIndex`: ``llmgw.gateway.feed.follow``, as ``llmgw
gateway`` runs it), whose per-replica keys the in-server gateway does not expose.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
from typing import Any

import httpx
from procs import Cluster

from llmgw.gateway.feed import FollowConfig, feed_channel, follow
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.gateway.routing.table import RoutingTable, Target

SIM_BIN = f"sim={sys.executable} -m llmgw sim-engine"
READY = "SHARD_STATE_READY"
SIM_ARGS = ("--sim-prefill-ms-per-token", "0.02", "--sim-decode-ms-per-token", "2")


def profile_file(replicas: int, *extra_args: str, adapters: dict[str, str] | None = None) -> str:
    """A ``kv-sim`` profile (KV events on, these LoRA adapters: name → path) and a ``chat``
    deployment of ``replicas``."""
    args = ", ".join(json.dumps(a) for a in (*SIM_ARGS, *extra_args))
    loras = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in (adapters or {}).items())
    loras = f"adapters = {{ {loras} }}" if loras else ""
    return f"""
[profiles.kv-sim]
engine = "sim"
gpu_class = "H100"
tp = 1
model_path = "/models/chat"
served_model_name = "chat"
kv_events = true
args = [{args}]
{loras}

[deployments.chat]
profile = "kv-sim"
replicas = {replicas}
"""


def ready_replicas(cluster: Cluster, count: int) -> list[dict[str, Any]] | None:
    """``llmgw get replicas`` when exactly ``count`` exist and all are READY."""
    out = cluster.cli("get", "replicas", "-o", "json", check=False)
    if out.returncode != 0:
        return None
    replicas = list(json.loads(out.stdout)["replicas"])
    ready = [r for r in replicas if r.get("state") == READY]
    return replicas if len(replicas) == count == len(ready) else None


def shards(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """``llmgw get shards``, by replica id (one shard per replica here)."""
    listed = json.loads(cluster.cli("get", "shards", "-o", "json").stdout)["shards"]
    return {s["replicaId"]: s for s in listed}


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", re.MULTILINE)


def metrics(base: str) -> dict[str, float]:
    """The gateway's samples as ``name{labels}`` → value."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return {f"{m[0]}{{{m[1]}}}" if m[1] else m[0]: float(m[2]) for m in _SAMPLE.findall(text)}


def system_prompt(group: int) -> str:
    words = " ".join(f"rule{group}x{i}" for i in range(700))
    return f"You are assistant {group}. Follow these rules: {words}"


class Conversation:
    """One user's chat, grown turn by turn with the engine's own answers."""

    def __init__(self, group: int, user: int, model: str = "chat") -> None:
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt(group)}]
        self.user = user
        self.model = model
        self.turns = 0

    def ask(self, client: httpx.Client) -> None:
        self.turns += 1
        question = f"User {self.user} asks question {self.turns}: " + "why " * 40
        self.messages.append({"role": "user", "content": question})
        reply = client.post(
            "/v1/chat/completions",
            json={"model": self.model, "messages": self.messages, "max_tokens": 24},
        )
        assert reply.status_code == 200, reply.text
        answer = reply.json()["choices"][0]["message"]["content"]
        self.messages.append({"role": "assistant", "content": answer})


# -- the engines, as they see themselves -------------------------------------------------------


def engine_keys(endpoint: str) -> set[int]:
    """The llmgw block keys of every block the engine's prefix cache holds now."""
    reply = httpx.get(f"{endpoint}/debug/kv_cache", timeout=5)
    assert reply.status_code == 200, reply.text
    return {int(key, 16) for key in reply.json()["keys"]}


def kv_event_hooks(endpoint: str) -> dict[str, Any]:
    """``GET /sim/kv_events``: next seq, dropped seqs, replays asked for (``--sim-test-hooks``)."""
    reply = httpx.get(f"{endpoint}/sim/kv_events", timeout=5)
    assert reply.status_code == 200, reply.text
    state: dict[str, Any] = reply.json()
    return state


def drop_kv_batches(endpoint: str, batches: int) -> dict[str, Any]:
    reply = httpx.post(f"{endpoint}/sim/kv_events/drop", json={"batches": batches}, timeout=5)
    assert reply.status_code == 200, reply.text
    state: dict[str, Any] = reply.json()
    return state


# -- a gateway's index, per replica ----------------------------------------------------------


class FeedIndex:
    """A `KvIndex` fed by the control server's router feed, as ``llmgw gateway`` feeds its
    own, in a thread with its own event loop; read through that loop (`keys_of`)."""

    def __init__(self, grpc_port: int) -> None:
        self.index = KvIndex()
        self.table = RoutingTable()
        self.error: BaseException | None = None
        self._port = grpc_port
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()  # bound to the loop that first waits on it
        self._thread = threading.Thread(target=self._run, name="feed-index")

    def __enter__(self) -> FeedIndex:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        assert not self._thread.is_alive(), "the feed follower did not stop"

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._follow())
        except Exception as exc:
            self.error = exc
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _follow(self) -> None:
        config = FollowConfig(base_s=0.2, cap_s=1.0)
        await follow(
            lambda: feed_channel("127.0.0.1", self._port, config),
            self.table,
            stop=self._stop,
            config=config,
            index=self.index,
        )

    def targets(self) -> dict[str, Target]:
        """The routing table's targets now (endpoints and API keys), by replica id."""
        assert self.error is None, f"the feed follower failed: {self.error!r}"

        async def read() -> dict[str, Target]:
            return {t.replica_id: t for t in self.table.targets()}

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(10)

    def keys_of(self, replica_id: str) -> set[int]:
        """The keys this index holds for ``replica_id`` now."""
        assert self.error is None, f"the feed follower failed: {self.error!r}"

        async def read() -> list[int]:
            return self.index.keys_of(replica_id)

        return set(asyncio.run_coroutine_threadsafe(read(), self._loop).result(10))
