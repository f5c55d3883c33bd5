"""Real vLLM, end to end: the CPU build of vLLM 0.32 serving SmolLM2-135M-Instruct.

The environment comes from ``scripts/setup-real-vllm`` (``.ci/run`` builds it first):
``LLMGW_REAL_VLLM_PYTHON`` and ``LLMGW_REAL_VLLM_MODEL`` from the environment, else from the
``env.sh`` it writes in ``${LLMGW_REAL_VLLM_DIR:-~/.cache/llmgw/real-vllm}``. Without it
these tests are skipped, saying how to build it; in CI (``CI=true``) they fail instead.

Two parts, as few engines as possible (each takes about a minute to become healthy):

- ``TestDirect``: one engine, started with the exact command line our vLLM adapter builds,
  serves /health, /v1/models, completions, /tokenize and /metrics, and publishes KV events
  on its ``ipc://`` endpoint whose block hashes are ``llmgw.kvcache``'s for the tokens that
  ``/tokenize`` returns (sha256_cbor, PYTHONHASHSEED=0, block size 128).
- ``test_real_vllm_shard_through_the_agent``: a server with ``--test-hooks`` and an agent
  run the same profile as a shard: LOADING → READY, a completion, /tokenize, kill -9 →
  restarted, adoption after an agent restart, and a drain with a request in flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from procs import Cluster, wait_for
from shardops import ShardWatch, command, listed_shards

from llmgw.addresses import free_port
from llmgw.agent.engines import EngineBinaries, LaunchSpec, ShardSpec, build_launch
from llmgw.agent.engines.vllm import API_SERVER_MODULE
from llmgw.agent.process import read_stat
from llmgw.api.llmgw.v1 import EngineProfile, ShardState
from llmgw.api.llmgw.v1 import StartShard as StartShardMessage
from llmgw.kvcache import (
    BlockStored,
    EventBatch,
    block_hashes,
    decode_batch,
    decode_frames,
    decode_replay_message,
    encode_replay_request,
    event_hash,
)

pytestmark = [pytest.mark.real_vllm, pytest.mark.integration, pytest.mark.slow]

log = logging.getLogger(__name__)

S = ShardState
SERVED = "smollm2-135m"
BLOCK_SIZE = 128  # vLLM's CPU backend
HELLO = "Hello world, this is a test"
HELLO_TOKENS = [19556, 905, 28, 451, 314, 253, 1028]  # spec/vllm-openai-server.md
PROFILE_ARGS = ["-O0", "--dtype", "float32", "--max-model-len", "2048"]
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's default asks for 92% of the NUMA node
    "HF_HUB_OFFLINE": "1",  # nothing downloads at test time
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
HEALTHY_WITHIN_S = 300.0
LOWEST_PRIORITY = ("nice", "-n", "19")
BACKOFF = ("--restart-backoff", "1", "--restart-backoff-max", "2")


# --- the environment ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RealVllm:
    """The venv's Python (which runs the OpenAI server module) and the converted model."""

    python: Path
    model: Path

    @property
    def binary(self) -> tuple[str, ...]:
        """The engine command, at the lowest CPU priority.

        A CPU vLLM's OpenMP threads take every core while it computes; beside the rest of
        the suite (three xdist workers on CI's two cores) they starved other tests' servers
        past 30 s to answer /healthz. At nice 19 the engine gets what the others leave.
        """
        return (*LOWEST_PRIORITY, str(self.python), "-m", API_SERVER_MODULE)


def _env_file_values(path: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the env.sh the setup script writes."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export":
            name, _, value = words[1].partition("=")
            values[name] = value
    return values


def locate_real_vllm() -> RealVllm | str:
    """The environment, or why there is none."""
    names = ("LLMGW_REAL_VLLM_PYTHON", "LLMGW_REAL_VLLM_MODEL")
    values = {name: os.environ.get(name, "") for name in names}
    source = "the environment"
    if not all(values.values()):
        cache = os.environ.get("LLMGW_REAL_VLLM_DIR") or Path.home() / ".cache/llmgw/real-vllm"
        env_file = Path(cache) / "env.sh"
        if not env_file.is_file():
            return f"no real vLLM environment ({env_file} is missing): run scripts/setup-real-vllm"
        values, source = _env_file_values(env_file), str(env_file)
    python, model = Path(values.get(names[0], "")), Path(values.get(names[1], ""))
    if not os.access(python, os.X_OK) or not (model / "model.safetensors").is_file():
        return f"{python} or {model} (from {source}) is missing: run scripts/setup-real-vllm"
    return RealVllm(python=python, model=model)


@pytest.fixture(scope="module")
def real_vllm() -> RealVllm:
    found = locate_real_vllm()
    if isinstance(found, RealVllm):
        return found
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the real vLLM tests (.ci/run builds it first): {found}")
    pytest.skip(found)


def profile(real: RealVllm) -> EngineProfile:
    return EngineProfile(
        name="smollm2-cpu",
        engine="vllm",
        gpu_class="cpu",
        model_path=str(real.model),
        served_model_name=SERVED,
        args=PROFILE_ARGS,
        env=ENGINE_ENV,
        kv_events=True,
    )


# --- processes ---------------------------------------------------------------------------


def session_members(session: int) -> list[int]:
    """Live processes of a session: an engine, its EngineCore and its workers."""
    members = []
    for entry in Path("/proc").iterdir():
        stat = read_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat.session == session and stat.state not in "ZXx":
            members.append(int(entry.name))
    return members


def api_servers_on_port(port: int) -> list[int]:
    """Pids of vLLM OpenAI servers whose command line has ``--port PORT``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        stat = read_stat(int(entry.name)) if argv else None
        if stat is None or stat.state in "ZXx" or API_SERVER_MODULE.encode() not in argv:
            continue
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            pids.append(int(entry.name))
    return pids


def kill_session(session: int, grace_s: float = 30.0) -> None:
    """SIGTERM every process of the session, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_members(session):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not session_members(session), grace_s, f"session {session} gone")
            return
    assert not session_members(session), f"engine session {session} survived SIGKILL"


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# --- HTTP --------------------------------------------------------------------------------


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(endpoint: str, key: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{endpoint}/v1/completions", json=body, headers=auth(key), timeout=120)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def tokenize(endpoint: str, key: str, prompt: str) -> list[int]:
    body = {"model": SERVED, "prompt": prompt}
    reply = httpx.post(f"{endpoint}/tokenize", json=body, headers=auth(key), timeout=30)
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def metric(endpoint: str, name: str) -> float:
    """The value of the (single) sample of ``name`` in /metrics."""
    text = httpx.get(f"{endpoint}/metrics", timeout=30).text
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    ]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


class Stream(threading.Thread):
    """One streaming completion of exactly ``max_tokens`` tokens, read to its end."""

    def __init__(self, endpoint: str, key: str, max_tokens: int) -> None:
        super().__init__(name="real-vllm-stream")
        self.endpoint, self.key, self.max_tokens = endpoint, key, max_tokens
        self.first_chunk = threading.Event()
        self.chunks: list[str] = []
        self.done_at_ms = 0
        self.error: Exception | None = None

    def run(self) -> None:
        body = {
            "model": SERVED,
            "prompt": "Tell me a long story about a lighthouse keeper.",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,  # vLLM's extension: exactly max_tokens tokens
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{self.endpoint}/v1/completions"
        try:
            with httpx.stream("POST", url, json=body, headers=auth(self.key), timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.chunks.append(line.removeprefix("data: "))
                        self.first_chunk.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.done_at_ms = time.time_ns() // 1_000_000
        self.first_chunk.set()

    def completion_tokens(self) -> int:
        """The completion tokens of the usage chunk (0 when there is none)."""
        usages = [json.loads(c).get("usage") for c in self.chunks if c != "[DONE]"]
        return max((int(u["completion_tokens"]) for u in usages if u), default=0)


# --- one engine, started directly with the adapter's command line --------------------------


@dataclass(frozen=True, slots=True)
class DirectEngine:
    launch: LaunchSpec
    model: Path
    endpoint: str
    key: str
    log_path: Path
    events: zmq.Socket[bytes]  # SUB, connected to the engine's KV event endpoint
    zmq_context: zmq.Context[zmq.Socket[bytes]]


def direct_launch(real: RealVllm, state_dir: Path) -> LaunchSpec:
    spec = ShardSpec(
        shard_id="direct-0",
        replica_id="direct",
        rank=0,
        profile=profile(real),
        fingerprint="fp-direct",
        gpu_uuids=(),
        port=free_port(),
        api_key="key-direct",
    )
    return build_launch(spec, binaries=EngineBinaries({"vllm": real.binary}), state_dir=state_dir)


def wait_healthy(proc: subprocess.Popen[bytes], endpoint: str, log_path: Path) -> float:
    """Seconds until /health answers 200; fails with the log's tail if the engine exits."""
    started = time.monotonic()

    def healthy() -> bool:
        assert proc.poll() is None, f"vLLM exited with {proc.returncode}:\n{log_tail(log_path)}"
        try:
            return httpx.get(f"{endpoint}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, HEALTHY_WITHIN_S, "vLLM's /health", every=1.0)
    return time.monotonic() - started


@pytest.fixture(scope="class")
def engine(real_vllm: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectEngine]:
    state_dir = tmp_path_factory.mktemp("real-vllm")
    launch = direct_launch(real_vllm, state_dir)
    assert launch.kv_events is not None
    for path in launch.kv_events.socket_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    context = zmq.Context()
    events = context.socket(zmq.SUB)
    events.setsockopt(zmq.SUBSCRIBE, b"")
    events.connect(launch.kv_events.endpoint)  # before the engine binds: no event is missed
    log_path = state_dir / "engine.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            launch.argv,
            env={**os.environ, **launch.env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    endpoint = f"http://127.0.0.1:{launch.port}"
    try:
        took = wait_healthy(proc, endpoint, log_path)
        log.info("real vLLM healthy after %.1f s", took)
        yield DirectEngine(
            launch, real_vllm.model, endpoint, launch.api_key, log_path, events, context
        )
    finally:
        kill_session(proc.pid)
        proc.wait(timeout=10)
        events.close(linger=0)
        context.term()


def receive_batches(events: zmq.Socket[bytes], blocks: int) -> list[tuple[int, EventBatch]]:
    """(seq, batch) of the messages published until ``blocks`` blocks were stored, and of
    any that follow within half a second (so an extra event would be seen)."""
    batches: list[tuple[int, EventBatch]] = []
    deadline = time.monotonic() + 30
    while (left := deadline - time.monotonic()) > 0 and events.poll(int(left * 1000)):
        topic, seq, payload = decode_frames(events.recv_multipart())
        assert topic == "kv-events"
        batches.append((seq, decode_batch(payload)))
        if sum(len(e.block_hashes) for e in stored_blocks(batches)) >= blocks:
            deadline = min(deadline, time.monotonic() + 0.5)
    return batches


def stored_blocks(batches: list[tuple[int, EventBatch]]) -> list[BlockStored]:
    return [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]


def replayed_batches(engine: DirectEngine) -> list[tuple[int, EventBatch]]:
    """Every batch the engine still buffers, asked for on its replay socket from seq 0."""
    assert engine.launch.kv_events is not None
    dealer = engine.zmq_context.socket(zmq.DEALER)
    try:
        dealer.connect(engine.launch.kv_events.replay_endpoint)
        dealer.send_multipart(encode_replay_request(0))
        batches: list[tuple[int, EventBatch]] = []
        while dealer.poll(10_000):
            message = decode_replay_message(dealer.recv_multipart())
            if message.is_end:
                return batches
            batches.append((message.seq, decode_batch(message.payload)))
        raise AssertionError(f"the replay did not end; got {len(batches)} batches")
    finally:
        dealer.close(linger=0)


@pytest.mark.timeout(600)  # the first test also waits for the engine to start
class TestDirect:
    def test_launch_is_the_module_style_command_line(self, engine: DirectEngine) -> None:
        argv = engine.launch.argv
        module_style = ("-m", API_SERVER_MODULE, "--model")
        assert argv[len(LOWEST_PRIORITY) + 1 :][:3] == module_style and "serve" not in argv
        assert argv[-len(PROFILE_ARGS) :] == tuple(PROFILE_ARGS)
        assert "--kv-events-config" in argv and "sha256_cbor" in argv
        assert engine.launch.env["PYTHONHASHSEED"] == "0"
        assert "--api-key" not in argv and engine.launch.env["VLLM_API_KEY"] == engine.key
        started = f"Starting vLLM server on {engine.endpoint}"
        assert started in engine.log_path.read_text(errors="replace")

    def test_models_needs_the_key_and_lists_the_served_name(self, engine: DirectEngine) -> None:
        assert httpx.get(f"{engine.endpoint}/v1/models", timeout=10).status_code == 401
        reply = httpx.get(f"{engine.endpoint}/v1/models", headers=auth(engine.key), timeout=10)
        (model,) = reply.json()["data"]
        assert (model["id"], model["max_model_len"]) == (SERVED, 2048)
        assert model["root"] == str(engine.model)

    def test_completion_is_greedy_and_sensible(self, engine: DirectEngine) -> None:
        result = complete(engine.endpoint, engine.key, "The capital of France is", 8)
        assert "Paris" in result["choices"][0]["text"]
        assert result["usage"]["prompt_tokens"] == 5 and result["model"] == SERVED

    def test_tokenize_answers_vllm_token_ids(self, engine: DirectEngine) -> None:
        reply = httpx.post(
            f"{engine.endpoint}/tokenize", json={"model": SERVED, "prompt": HELLO}, timeout=10
        )  # no key: vLLM guards only /v1, /v2, /inference and /cohere
        assert reply.json() == {
            "count": 7,
            "max_model_len": 2048,
            "tokens": HELLO_TOKENS,
            "token_strs": None,
        }

    def test_metrics_have_the_names_the_agent_and_gateway_read(self, engine: DirectEngine) -> None:
        text = httpx.get(f"{engine.endpoint}/metrics", timeout=10).text
        labels = f'{{engine="0",model_name="{SERVED}"}}'
        for name in ("vllm:num_requests_running", "vllm:prefix_cache_hits_total"):
            assert f"{name}{labels} " in text
        assert 'block_size="128"' in text and 'enable_prefix_caching="True"' in text
        assert "vllm:gpu_cache_usage_perc" not in text  # gone in 0.32

    def test_kv_events_carry_llmgw_block_hashes(self, engine: DirectEngine) -> None:
        prompt = " ".join(f"lighthouse{i}" for i in range(120))
        tokens = tokenize(engine.endpoint, engine.key, prompt)
        blocks = len(tokens) // BLOCK_SIZE
        assert blocks >= 2 and len(tokens) % BLOCK_SIZE, len(tokens)
        expected = [
            event_hash(digest)
            for digest in block_hashes(
                tokens, BLOCK_SIZE, algo="sha256_cbor", seed="0", vllm_version="0.32.0"
            )
        ]
        hits_before = metric(engine.endpoint, "vllm:prefix_cache_hits_total")
        complete(engine.endpoint, engine.key, prompt, 1)
        batches = receive_batches(engine.events, blocks)
        stored = stored_blocks(batches)
        assert [h for e in stored for h in e.block_hashes] == expected
        assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK_SIZE
        assert [t for e in stored for t in e.token_ids] == tokens[: blocks * BLOCK_SIZE]
        seqs = [seq for seq, _ in batches]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        # the replay socket holds the same batches
        replayed = dict(replayed_batches(engine))
        assert all(replayed[seq] == batch for seq, batch in batches)
        # the same prompt again: every full block comes from the prefix cache
        complete(engine.endpoint, engine.key, prompt, 1)
        hits = metric(engine.endpoint, "vllm:prefix_cache_hits_total") - hits_before
        assert hits == blocks * BLOCK_SIZE


# --- the same engine as a shard, through the server and an agent ---------------------------


def start_agent(fleet: Cluster, real: RealVllm) -> None:
    engine_bin = f"vllm={shlex.join(real.binary)}"
    fleet.start_agent("n1", "cpu-only", "--engine-bin", engine_bin, *BACKOFF)


def start_message(real: RealVllm, port: int) -> dict[str, Any]:
    message = StartShardMessage(
        shard_id="rv-0",
        replica_id="rv",
        profile=profile(real),
        profile_fingerprint="fp-rv",
        port=port,
        api_key="key-rv",
    )
    return {"startShard": message.to_dict()}


@pytest.mark.timeout(900)
def test_real_vllm_shard_through_the_agent(real_vllm: RealVllm, fleet: Cluster) -> None:
    fleet.start_server("--test-hooks")
    start_agent(fleet, real_vllm)
    wait_for(lambda: fleet.node_states().get("n1") == "NODE_STATE_READY", 60, "n1 READY")
    port = free_port()
    with ShardWatch(fleet.url) as watch:
        # StartShard: PENDING → STARTING → LOADING → READY, then it serves
        command(fleet, "n1", start_message(real_vllm, port))
        ready = watch.wait("rv-0", S.READY, within=HEALTHY_WITHIN_S)
        assert watch.states("rv-0") == [S.PENDING, S.STARTING, S.LOADING, S.READY]
        assert ready.endpoint == f"http://127.0.0.1:{port}" and ready.engine == "vllm"
        answer = complete(ready.endpoint, "key-rv", "The capital of France is", 8)
        assert "Paris" in answer["choices"][0]["text"]
        assert tokenize(ready.endpoint, "key-rv", HELLO) == HELLO_TOKENS
        assert api_servers_on_port(port) == [ready.pid]

        # kill -9 the API server: FAILED, its EngineCore and workers are gone, READY again
        os.kill(ready.pid, signal.SIGKILL)
        failed = watch.wait("rv-0", S.FAILED, within=30)
        assert failed.exited and failed.exit_code == -9
        again = watch.wait("rv-0", S.READY, nth=2, within=HEALTHY_WITHIN_S)
        assert again.restarts == 1 and again.pid != ready.pid
        assert session_members(ready.pid) == []
        assert api_servers_on_port(port) == [again.pid]
        engine_processes = sorted(session_members(again.pid))

        # kill -9 the agent: the engine keeps serving; a new agent adopts it
        fleet.kill("n1")
        assert complete(again.endpoint, "key-rv", HELLO, 4)["choices"][0]["text"]
        start_agent(fleet, real_vllm)
        adopted = watch.wait("rv-0", S.READY, nth=3, within=60)
        assert adopted.pid == again.pid and adopted.restarts == 1
        assert any("adopted engine pid" in s.reason for s in watch.of("rv-0")[-3:])
        assert sorted(session_members(again.pid)) == engine_processes  # no second engine
        listed = listed_shards(fleet)["rv-0"]["status"]
        assert (listed["state"], listed["pid"]) == ("SHARD_STATE_READY", again.pid)

        # drain with a request in flight: it completes, then STOPPED, nothing left running.
        # 1,024 tokens take several seconds even on a fast CPU, so the drain (a CLI call, then
        # the agent) lands while they stream; 96 once finished first on a quicker machine.
        stream = Stream(adopted.endpoint, "key-rv", max_tokens=1024)
        stream.start()
        assert stream.first_chunk.wait(60)
        # The grace is only a bound: the drain ends when the stream does. This machine's CPU
        # vLLM streams 5-9 tokens/s while the suite runs, so 1,024 tokens may take 200 s.
        command(fleet, "n1", {"drainShard": {"shardId": "rv-0", "graceSeconds": 600}})
        draining = watch.wait("rv-0", S.DRAINING, within=10)
        stream.join(600)
        stopped = watch.wait("rv-0", S.STOPPED, within=600)
    assert stream.error is None and stream.chunks[-1] == "[DONE]"
    assert stream.completion_tokens() == stream.max_tokens, stream.chunks[-4:]
    assert stopped.reason == "drained: no request in flight"
    assert draining.since_unix_ms < stream.done_at_ms <= stopped.since_unix_ms + 50
    assert session_members(again.pid) == []
