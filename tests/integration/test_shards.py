"""Shards end to end: a server with --test-hooks, agents, and ``llmgw sim-engine`` engines,
all real processes on loopback.

Commands go to the agents through the server's test hook (a stand-in for the reconciler);
every shard state the server publishes is collected from a Watch stream, so short states
(STARTING, LOADING) are seen as well as long ones.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import Cluster, wait_for
from shardops import ShardWatch, command, listed_shards

from llmgw.addresses import free_port
from llmgw.agent.engines import EngineBinaries, build_launch
from llmgw.agent.engines.base import ShardSpec
from llmgw.agent.process import read_stat
from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter, MultiNode, ShardState
from llmgw.api.llmgw.v1 import StartShard as StartShardMessage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

S = ShardState
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "2")
SIM_BIN = f"vllm={sys.executable} -m llmgw sim-engine"


def gpu_uuids(cluster: Cluster, node_id: str) -> list[str]:
    return [g["uuid"] for g in cluster.nodes()[node_id]["info"]["gpus"]]


def engines_on_port(port: int) -> list[int]:
    """Pids of sim engines whose command line has ``--port PORT``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = read_stat(int(entry.name))
        if stat is None or stat.state in "ZX":
            continue
        if (
            b"sim-engine" in argv
            and b"--port" in argv
            and argv[argv.index(b"--port") + 1] == b"%d" % port
        ):
            pids.append(int(entry.name))
    return pids


def complete(endpoint: str, key: str, model: str, *, max_tokens: int = 4) -> dict[str, Any]:
    reply = httpx.post(
        f"{endpoint}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


class Stream(threading.Thread):
    """One streaming completion, read to its end."""

    def __init__(self, endpoint: str, key: str, model: str, max_tokens: int) -> None:
        super().__init__(name="stream")
        self.args = (endpoint, key, model, max_tokens)
        self.first_chunk = threading.Event()
        self.chunks: list[str] = []
        self.done_at_ms = 0
        self.error: Exception | None = None

    def run(self) -> None:
        endpoint, key, model, max_tokens = self.args
        body = {
            "model": model,
            "prompt": "Tell me a story",
            "max_tokens": max_tokens,
            "ignore_eos": True,  # vLLM's extension: exactly max_tokens tokens
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {key}"}
        try:
            with httpx.stream(
                "POST", f"{endpoint}/v1/completions", json=body, headers=headers, timeout=60
            ) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line.removeprefix("data: "))
                        self.first_chunk.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.done_at_ms = time.time_ns() // 1_000_000
        self.first_chunk.set()


# --- the lifecycle of a sim shard --------------------------------------------------------


def test_sim_shard_lifecycle_restart_adoption_and_drain(fleet: Cluster) -> None:
    fleet.start_server("--test-hooks")
    fleet.start_agent("n1", "dgx-h100", *BACKOFF)
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 30, "n1 READY")
    port = free_port()
    start = {
        "shardId": "r1-0",
        "replicaId": "r1",
        "profile": {
            "name": "tiny-sim",
            "engine": "sim",
            "tp": 1,
            "modelPath": "/models/tiny",
            "servedModelName": "tiny",
            "args": ["--sim-load-seconds", "2", "--sim-decode-ms-per-token", "40"],
        },
        "profileFingerprint": "fp-tiny-1",
        "gpuUuids": gpu_uuids(fleet, "n1")[:1],
        "port": port,
        "apiKey": "key-r1",
    }
    with ShardWatch(fleet.url) as watch:
        # StartShard: PENDING → STARTING → LOADING → READY, then it serves
        command(fleet, "n1", {"startShard": start})
        ready = watch.wait("r1-0", S.READY)
        assert watch.states("r1-0") == [S.PENDING, S.STARTING, S.LOADING, S.READY]
        starting = watch.of("r1-0")[1]
        assert ready.since_unix_ms - starting.since_unix_ms >= 2000  # the load took 2 s
        assert ready.endpoint == f"http://127.0.0.1:{port}" and ready.pid > 0
        assert ready.engine == "sim" and ready.profile_fingerprint == "fp-tiny-1"
        assert complete(ready.endpoint, "key-r1", "tiny")["choices"][0]["text"]
        assert listed_shards(fleet)["r1-0"]["status"]["state"] == "SHARD_STATE_READY"

        # kill -9 the engine: FAILED, restarted after the backoff, READY again
        os.kill(ready.pid, signal.SIGKILL)
        failed = watch.wait("r1-0", S.FAILED)
        assert failed.exited and failed.exit_code == -9 and "SIGKILL" in failed.reason
        again = watch.wait("r1-0", S.READY, nth=2)
        restarted = [s for s in watch.of("r1-0") if s.state is S.STARTING][1]
        assert restarted.since_unix_ms - failed.since_unix_ms >= 1000  # the backoff
        assert again.restarts == 1 and again.pid != ready.pid
        assert engines_on_port(port) == [again.pid]

        # kill -9 the agent: the engine keeps serving
        fleet.kill("n1")
        assert complete(again.endpoint, "key-r1", "tiny")["choices"]
        assert engines_on_port(port) == [again.pid]

        # the agent again: it adopts the engine (same pid, no second engine), READY
        fleet.start_agent("n1", "dgx-h100", *BACKOFF)
        adopted = watch.wait("r1-0", S.READY, nth=3)
        assert adopted.pid == again.pid and adopted.restarts == 1
        assert any("adopted engine pid" in s.reason for s in watch.of("r1-0")[-3:])
        assert engines_on_port(port) == [again.pid]
        listed = listed_shards(fleet)["r1-0"]["status"]
        assert (listed["state"], listed["pid"]) == ("SHARD_STATE_READY", again.pid)

        # drain with streams in flight: they all complete, then STOPPED
        streams = [Stream(adopted.endpoint, "key-r1", "tiny", 50) for _ in range(3)]
        for stream in streams:
            stream.start()
        for stream in streams:
            assert stream.first_chunk.wait(20)
        command(fleet, "n1", {"drainShard": {"shardId": "r1-0", "graceSeconds": 60}})
        watch.wait("r1-0", S.DRAINING)
        for stream in streams:
            stream.join(30)
        stopped = watch.wait("r1-0", S.STOPPED)
    assert all(s.error is None and s.chunks[-1] == "[DONE]" for s in streams)
    for stream in streams:  # every token arrived, and the stream ended as vLLM ends it
        last = json.loads(stream.chunks[-2])["choices"][0]
        assert len(stream.chunks) == 51 and last["finish_reason"] == "length"
    assert stopped.since_unix_ms >= max(s.done_at_ms for s in streams) - 50
    assert stopped.reason == "drained: no request in flight"
    assert engines_on_port(port) == []
    assert not (fleet.root / "n1" / "engines" / "r1-0.json").exists()


# --- the vLLM adapter's profiles, run against the simulated engine -----------------------


def test_vllm_profiles_run_against_the_sim_engine(fleet: Cluster) -> None:
    fleet.start_server("--test-hooks")
    for node in ("n1", "n2"):
        fleet.start_agent(node, "dgx-h100", "--engine-bin", SIM_BIN, *BACKOFF)
    wait_for(
        lambda: fleet.node_states() == {"n1": "NODE_STATE_READY", "n2": "NODE_STATE_READY"},
        30,
        "n1 and n2 READY",
    )
    tp8 = EngineProfile(
        name="llama70b",
        engine="vllm",
        gpu_class="H100",
        tp=8,
        model_path="/models/Llama-3.1-70B-Instruct",
        adapters=[LoraAdapter(name="sql", path="/loras/sql")],
        kv_events=True,
    )
    with ShardWatch(fleet.url) as watch:
        # TP=8 on the eight GPUs of n1, with a LoRA adapter and KV events
        message = StartShardMessage(
            shard_id="big-0",
            replica_id="big",
            profile=tp8,
            profile_fingerprint="fp-tp8",
            gpu_uuids=gpu_uuids(fleet, "n1"),
            port=free_port(),
            api_key="key-big",
        )
        command(fleet, "n1", {"startShard": message.to_dict()})
        ready = watch.wait("big-0", S.READY)
        models = httpx.get(
            f"{ready.endpoint}/v1/models", headers={"Authorization": "Bearer key-big"}, timeout=10
        ).json()
        assert {m["id"] for m in models["data"]} == {"Llama-3.1-70B-Instruct", "sql"}
        assert complete(ready.endpoint, "key-big", "sql")["choices"]
        launch = build_launch(
            ShardSpec.from_start(message),
            binaries=EngineBinaries({"vllm": (sys.executable, "-m", "llmgw", "sim-engine")}),
            state_dir=fleet.root / "n1",
        )
        assert launch.kv_events is not None
        sockets = launch.kv_events.socket_paths
        assert all(p.exists() for p in sockets)  # the engine bound its KV event sockets
        log = (fleet.root / "n1" / "logs" / "big-0.log").read_text()
        assert "--tensor-parallel-size 8" in log and "--kv-events-config" in log
        command(fleet, "n1", {"stopShard": {"shardId": "big-0", "graceSeconds": 10}})
        assert watch.wait("big-0", S.STOPPED).exit_code == 0  # SIGTERM: a clean exit
        shutil.rmtree(sockets[0].parent, ignore_errors=True)

        # two nodes, TP=8 PP=2: rank 0 serves on n1, rank 1 runs headless on n2
        master = free_port()
        port = free_port()
        two_node = EngineProfile(
            name="llama70b-2n",
            engine="vllm",
            gpu_class="H100",
            tp=8,
            pp=2,
            gpus_per_node=8,
            nodes=2,
            model_path="/models/Llama-3.1-70B-Instruct",
        )
        for rank, node in enumerate(("n1", "n2")):
            message = StartShardMessage(
                shard_id=f"mn-{rank}",
                replica_id="mn",
                rank=rank,
                profile=two_node,
                profile_fingerprint="fp-2n",
                gpu_uuids=gpu_uuids(fleet, node),
                port=port if rank == 0 else 0,
                api_key="key-mn",
                multinode=MultiNode(
                    nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=master
                ),
            )
            command(fleet, node, {"startShard": message.to_dict()})
        leader = watch.wait("mn-0", S.READY)
        follower = watch.wait("mn-1", S.READY)
    assert leader.endpoint == f"http://127.0.0.1:{port}" and follower.endpoint == ""
    assert complete(leader.endpoint, "key-mn", "Llama-3.1-70B-Instruct")["choices"]
    follower_log = fleet.root / "n2" / "logs" / "mn-1.log"
    assert "--headless" in follower_log.read_text()
    wait_for(lambda: "Headless node 1 of 2" in follower_log.read_text(), 20, "the headless rank")
    assert follower.pid > 0 and follower.reason == "headless rank: running (the leader serves)"
