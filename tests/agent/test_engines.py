"""Engine adapters: profile + shard → the exact command line and environment."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.engines import (
    ADAPTERS,
    EngineBinaries,
    EngineError,
    KvEventEndpoints,
    LaunchSpec,
    ShardSpec,
    build_launch,
    engine_binaries,
    parse_engine_bin,
)
from llmgw.agent.engines.sglang import LAUNCHER as SGLANG_LAUNCHER
from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter, MultiNode, StartShard
from llmgw.cli.main import build_parser, main

STATE = Path("/srv/llmgw/agent")
MODEL = "/models/Llama-3.1-70B-Instruct"
NAME = "Llama-3.1-70B-Instruct"
GPUS = tuple(f"GPU-5a3f0e2c-8d41-4b7e-9c1a-00000000000{i}" for i in range(8))
GPUS_CSV = ",".join(GPUS)  # CUDA_VISIBLE_DEVICES takes the UUIDs comma-joined
MIG = "MIG-0e6f6b07-1d5c-5a8e-a3f4-6b6d3c7e9a21"
TP8 = ("--tensor-parallel-size", "8", "--pipeline-parallel-size", "1")
TP1 = ("--tensor-parallel-size", "1", "--pipeline-parallel-size", "1")
LISTEN = ("--host", "127.0.0.1", "--port", "8001")
VLLM_LISTEN = (*LISTEN, "--enable-prompt-tokens-details")  # vLLM's: cached tokens in usage
KV_JSON = (
    '{"enable_kv_cache_events":true,"publisher":"zmq",'
    '"endpoint":"ipc:///srv/llmgw/agent/kv/r1-s0.pub",'
    '"replay_endpoint":"ipc:///srv/llmgw/agent/kv/r1-s0.replay","topic":"kv-events"}'
)
KV_ENV = {"PYTHONHASHSEED": "0", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
VLLM_KEY = {"VLLM_API_KEY": "sk-r1"}  # the key goes in the environment, never in argv
SGLANG_KEY = {"LLMGW_ENGINE_API_KEY": "sk-r1"}  # read by the launcher (sglang.py)
API_SERVER = ("/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server")


def profile(**fields: Any) -> EngineProfile:
    base: dict[str, Any] = {
        "name": "llama70b",
        "engine": "vllm",
        "gpu_class": "H100",
        "tp": 8,
        "model_path": MODEL,
    }
    return EngineProfile(**{**base, **fields})


def shard(prof: EngineProfile, **fields: Any) -> ShardSpec:
    base: dict[str, Any] = {
        "shard_id": "r1-s0",
        "replica_id": "r1",
        "rank": 0,
        "profile": prof,
        "fingerprint": "fp1",
        "gpu_uuids": GPUS,
        "port": 8001,
        "api_key": "sk-r1",
    }
    return ShardSpec(**{**base, **fields})


def launch(
    spec: ShardSpec, bins: dict[str, tuple[str, ...]] | None = None, state: Path = STATE
) -> LaunchSpec:
    return build_launch(spec, binaries=EngineBinaries(bins or {}), state_dir=state)


def two_nodes(rank: int, **fields: Any) -> ShardSpec:
    prof = profile(tp=8, pp=2, gpus_per_node=8, nodes=2, **fields)
    where = MultiNode(
        nnodes=2,
        node_rank=rank,
        master_addr="10.1.0.11",
        master_port=29501,
        hcas=["mlx5_0", "mlx5_1"],
        management_interface="eno1",
    )
    return shard(prof, rank=rank, multinode=where)


# --- vLLM -------------------------------------------------------------------------------


def test_vllm_tp8_on_eight_gpus() -> None:
    out = launch(shard(profile()))
    assert out.argv == (*("vllm", "serve", MODEL, *VLLM_LISTEN, "--served-model-name", NAME), *TP8)
    assert out.env == {"CUDA_VISIBLE_DEVICES": GPUS_CSV, **VLLM_KEY}
    assert (out.engine, out.port, out.api_key) == ("vllm", 8001, "sk-r1")
    assert out.secret_env == {"VLLM_API_KEY"}
    assert (out.health_path, out.ready_path) == ("/health", "/v1/models")
    assert out.listens_http and out.kv_events is None


MULTINODE_TAIL = (
    *("--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"),
    *("--nnodes", "2", "--node-rank"),
)
MASTER = (
    *("--master-addr", "10.1.0.11", "--master-port", "29501"),
    *("--distributed-executor-backend", "mp", "--data-parallel-backend", "mp"),
)
FABRIC_ENV = {
    "CUDA_VISIBLE_DEVICES": GPUS_CSV,
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1",  # exact names: mlx5_1 must not select mlx5_10
    "NCCL_SOCKET_IFNAME": "eno1",
    "GLOO_SOCKET_IFNAME": "eno1",
}


def test_vllm_two_nodes_tp8_pp2_rank0_is_the_leader() -> None:
    out = launch(two_nodes(0))
    assert out.argv == (
        *("vllm", "serve", MODEL, *VLLM_LISTEN, "--served-model-name", NAME),
        *MULTINODE_TAIL,
        "0",
        *MASTER,
    )
    assert out.env == {**FABRIC_ENV, **VLLM_KEY}
    assert out.listens_http


def test_vllm_two_nodes_rank1_is_headless_without_http_flags() -> None:
    out = launch(two_nodes(1))
    assert out.argv == (
        *("vllm", "serve", MODEL, "--served-model-name", NAME, *MULTINODE_TAIL, "1"),
        *MASTER,
        "--headless",
    )
    assert out.env == FABRIC_ENV
    assert not out.listens_http


def test_vllm_headless_rank_keeps_kv_flags_but_has_no_publisher_to_connect_to() -> None:
    out = launch(two_nodes(1, kv_events=True))
    assert out.argv[-5:] == (
        *("--kv-events-config", KV_JSON, "--enable-prefix-caching"),
        *("--prefix-caching-hash-algo", "sha256_cbor"),
    )
    assert out.kv_events is None
    assert out.env == {**FABRIC_ENV, **KV_ENV}


def test_vllm_lora_adapters() -> None:
    loras = [LoraAdapter(name="sql", path="/loras/sql"), LoraAdapter(name="chat", path="/l/c")]
    out = launch(shard(profile(tp=1, adapters=loras), gpu_uuids=GPUS[:1]))
    assert out.argv == (
        *("vllm", "serve", MODEL, *VLLM_LISTEN, "--served-model-name", NAME, *TP1),
        *("--enable-lora", "--lora-modules", "sql=/loras/sql", "chat=/l/c", "--max-loras", "2"),
    )
    assert out.env == {"CUDA_VISIBLE_DEVICES": GPUS[0], **VLLM_KEY}


def test_vllm_kv_events_with_profile_args_and_env() -> None:
    prof = profile(
        tp=1,
        served_model_name="llama",
        kv_events=True,
        args=["--max-model-len", "8192"],
        env={"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"},
    )
    out = launch(shard(prof, gpu_uuids=(MIG,)))
    assert out.argv == (
        *("vllm", "serve", MODEL, *VLLM_LISTEN, "--served-model-name", "llama", *TP1),
        *("--kv-events-config", KV_JSON, "--enable-prefix-caching"),
        *("--prefix-caching-hash-algo", "sha256_cbor", "--max-model-len", "8192"),
    )
    assert out.env == {
        "CUDA_VISIBLE_DEVICES": MIG,  # a MIG UUID is passed as it is
        "PYTHONHASHSEED": "0",
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0",  # the profile may ask for bytes hashes
        "VLLM_LOGGING_LEVEL": "DEBUG",
        **VLLM_KEY,
    }
    assert out.kv_events == KvEventEndpoints(
        "ipc:///srv/llmgw/agent/kv/r1-s0.pub", "ipc:///srv/llmgw/agent/kv/r1-s0.replay"
    )
    assert out.kv_events.socket_paths == (
        Path("/srv/llmgw/agent/kv/r1-s0.pub"),
        Path("/srv/llmgw/agent/kv/r1-s0.replay"),
    )
    # The keys are vLLM's KVEventsConfig fields (spec/vllm-kv-events.md §2.2).
    assert json.loads(KV_JSON) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": out.kv_events.endpoint,
        "replay_endpoint": out.kv_events.replay_endpoint,
        "topic": "kv-events",
    }


def test_vllm_api_server_module_takes_model_flag_on_cpu() -> None:
    prof = profile(tp=1, gpu_class="cpu", cpu_threads=2, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    out = launch(shard(prof, gpu_uuids=()), {"vllm": API_SERVER})
    assert out.argv == (
        *API_SERVER,
        *("--model", MODEL, *VLLM_LISTEN, "--served-model-name", NAME, *TP1),
    )
    assert out.env == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # OpenMP then takes OMP_NUM_THREADS threads
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        **VLLM_KEY,
    }


def test_vllm_cpu_without_threads_or_key_adds_nothing() -> None:
    out = launch(shard(profile(tp=1, gpu_class="cpu"), gpu_uuids=(), api_key=""))
    assert out.argv == ("vllm", "serve", MODEL, *VLLM_LISTEN, "--served-model-name", NAME, *TP1)
    assert out.env == {}


def test_vllm_cli_module_is_serve_style_and_may_run_headless() -> None:
    cli = ("python3", "-m", "vllm.entrypoints.cli.main")
    out = launch(two_nodes(1), {"vllm": cli})
    assert out.argv[:5] == (*cli, "serve", MODEL)
    assert out.argv[-1] == "--headless"


def _long_dir(root: Path, length: int = 100) -> Path:
    """A folder under ``root`` whose path is ``length`` bytes long."""
    return root / ("x" * (length - len(str(root)) - 1))


def test_long_state_dir_moves_ipc_sockets_to_a_private_random_folder(tmp_path: Path) -> None:
    state = _long_dir(tmp_path)
    out = launch(shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1]), state=state)
    assert out.kv_events is not None
    short = Path((state / "kv-ipc-dir").read_text().strip())  # remembered for restarts
    try:
        assert short.parent == Path("/tmp") and short.name.startswith("llmgw-kv-")
        name = hashlib.sha256(b"r1-s0").hexdigest()[:24]
        assert out.kv_events == KvEventEndpoints(
            f"ipc://{short}/{name}.pub", f"ipc://{short}/{name}.replay"
        )
        assert (
            f'"endpoint":"ipc://{short}/{name}.pub"'
            in out.argv[out.argv.index("--kv-events-config") + 1]
        )
        info = short.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.geteuid()
        # the same folder for the next agent on this state dir: its engines' sockets
        again = launch(shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1]), state=state)
        assert again.kv_events == out.kv_events
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_a_short_folder_others_could_use_is_refused(tmp_path: Path) -> None:
    state = _long_dir(tmp_path)
    spec = shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1])
    launch(spec, state=state)
    short = Path((state / "kv-ipc-dir").read_text().strip())
    try:
        short.chmod(0o777)
        with pytest.raises(EngineError, match=r"kv_events: .* has mode 0777 .*remove it"):
            launch(spec, state=state)
        short.rmdir()  # gone (a reboot): a new random one
        assert launch(spec, state=state).kv_events is not None
        assert Path((state / "kv-ipc-dir").read_text().strip()) != short
    finally:
        shutil.rmtree(Path((state / "kv-ipc-dir").read_text().strip()), ignore_errors=True)


def test_socket_path_limit_is_107_bytes(tmp_path: Path) -> None:
    spec = shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1])
    at_limit = _long_dir(tmp_path, 91)  # …/kv/r1-s0.replay is exactly 107 bytes
    kv = launch(spec, state=at_limit).kv_events
    assert kv is not None and kv.replay_endpoint == f"ipc://{at_limit}/kv/r1-s0.replay"
    assert len(str(kv.socket_paths[1])) == 107
    over_dir = _long_dir(tmp_path, 92)
    over = launch(spec, state=over_dir).kv_events
    assert over is not None and over.endpoint.startswith("ipc:///tmp/llmgw-kv-")
    shutil.rmtree(over.socket_paths[0].parent)


def test_short_paths_differ_per_agent_and_shard(tmp_path: Path) -> None:
    state = _long_dir(tmp_path)
    other = _long_dir(tmp_path / "y")
    prof = profile(tp=1, kv_events=True)
    paths = {
        launch(shard(prof, gpu_uuids=GPUS[:1], shard_id=sid), state=st).kv_events
        for sid, st in (("a", state), ("b", state), ("a", other))
    }
    assert len(paths) == 3
    for kv in paths:
        assert kv is not None
        shutil.rmtree(kv.socket_paths[0].parent, ignore_errors=True)


def test_relative_state_dir_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    kv = launch(
        shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1]), state=Path("st")
    ).kv_events
    assert kv is not None and kv.endpoint == f"ipc://{tmp_path}/st/kv/r1-s0.pub"


def test_served_model_name_defaults_to_last_path_component() -> None:
    out = launch(shard(profile(tp=1, model_path="meta-llama/Llama-3.1-8B/"), gpu_uuids=GPUS[:1]))
    assert out.argv[out.argv.index("--served-model-name") + 1] == "Llama-3.1-8B"


def test_from_start_message_builds_the_same_launch() -> None:
    message = StartShard(
        shard_id="r1-s0",
        replica_id="r1",
        profile=profile(),
        profile_fingerprint="fp1",
        gpu_uuids=list(GPUS),
        port=8001,
        api_key="sk-r1",
    )
    spec = ShardSpec.from_start(message)
    assert launch(spec) == launch(shard(profile(), multinode=spec.multinode))


# --- Refusals: each names the field at fault ---------------------------------------------

ONE_GPU = {"gpu_uuids": GPUS[:1]}
REFUSALS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("tp", {"tp": 4}, {}),
    ("tp", {"tp": 4, "pp": 1}, {"gpu_uuids": ()}),
    ("model_path", {"tp": 1, "model_path": ""}, ONE_GPU),
    ("served_model_name", {"tp": 1, "model_path": "/"}, ONE_GPU),
    ("served_model_name", {"tp": 1, "served_model_name": "a b"}, ONE_GPU),
    ("env", {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, {}),
    ("env", {"kv_events": True, "env": {"PYTHONHASHSEED": "1"}}, {}),
    ("env", {"env": {"LD_PRELOAD": "/tmp/x.so"}}, {}),
    ("env", {"env": {"VLLM_LOGGING_LEVEL": "INFO\nX"}}, {}),
    ("args", {"args": ["--po", "1234"]}, {}),
    ("args", {"engine": "sglang", "tp": 1, "args": ["--tp-si=2"]}, ONE_GPU),
    ("env", {"env": {"A=B": "1"}}, {}),
    ("env", {"env": {"VLLM_API_KEY": "mine"}}, {}),
    ("env", {"engine": "sglang", "tp": 1, "env": {"LLMGW_ENGINE_API_KEY": "x"}}, ONE_GPU),
    (
        "env",
        {"engine": "llamacpp", "tp": 1, "model_path": "/m.gguf", "env": {"LLAMA_API_KEY": "x"}},
        ONE_GPU,
    ),
    ("args", {"args": ["--api-key", "mine"]}, {}),
    (
        "args",
        {"engine": "llamacpp", "tp": 1, "model_path": "/m.gguf", "args": ["--api-key-file", "/k"]},
        ONE_GPU,
    ),
    ("args", {"args": ["--port", "9000"]}, {}),
    ("args", {"args": ["--tensor_parallel_size=4"]}, {}),
    ("args", {"args": ["-tp", "4"]}, {}),
    ("args", {"kv_events": True, "args": ["--kv-events-config.endpoint", "tcp://*:5557"]}, {}),
    ("args", {"kv_events": True, "args": ["--prefix-caching-hash-algo=sha256"]}, {}),
    (
        "adapters[1].name",
        {"tp": 1, "adapters": [LoraAdapter(name="a", path="/a"), LoraAdapter(name="a", path="/b")]},
        ONE_GPU,
    ),
    ("adapters[0].path", {"tp": 1, "adapters": [LoraAdapter(name="a")]}, ONE_GPU),
    ("gpu_class", {"tp": 1, "gpu_class": "cpu"}, ONE_GPU),
    ("gpu_uuids", {"tp": 2}, {"gpu_uuids": (MIG, MIG.replace("0e6", "1e6"))}),
    ("nodes", {"nodes": 2}, {}),
    ("port", {}, {"port": 0}),
    ("port", {}, {"port": 70000}),
    ("shard_id", {"kv_events": True}, {"shard_id": "../etc"}),
    ("shard_id", {"kv_events": True}, {"shard_id": "r1\n"}),
    ("engine", {"engine": "tgi"}, {}),
    ("kv_events", {"engine": "sglang", "kv_events": True}, {}),
    ("model_path", {"engine": "llamacpp", "tp": 1}, ONE_GPU),
    ("tp", {"engine": "llamacpp", "tp": 2, "model_path": "/m.gguf"}, {"gpu_uuids": GPUS[:2]}),
    ("adapters", {"engine": "llamacpp", "tp": 1, "adapters": [LoraAdapter(name="a")]}, ONE_GPU),
    ("kv_events", {"engine": "llamacpp", "tp": 1, "kv_events": True}, ONE_GPU),
]


@pytest.mark.parametrize(("field", "prof", "fields"), REFUSALS)
def test_refusals_name_their_field(
    field: str, prof: dict[str, Any], fields: dict[str, Any]
) -> None:
    with pytest.raises(EngineError) as info:
        launch(shard(profile(**prof), **fields))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert "'llama70b'" in str(info.value)


MULTINODE_REFUSALS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("gpus_per_node", {"gpus_per_node": 0}, {}),
    ("gpus_per_node", {"gpus_per_node": 4}, {}),
    ("tp", {"pp": 1}, {}),
    ("nodes", {"nodes": 3}, {}),
    ("multinode.node_rank", {}, {"node_rank": 2}),
    ("multinode.master_addr", {}, {"master_addr": ""}),
    ("multinode.master_port", {}, {"master_port": 0}),
]


@pytest.mark.parametrize(("field", "prof", "where"), MULTINODE_REFUSALS)
def test_multinode_refusals_name_their_field(
    field: str, prof: dict[str, Any], where: dict[str, Any]
) -> None:
    fields = {"tp": 8, "pp": 2, "gpus_per_node": 8, "nodes": 2, **prof}
    mn = {"nnodes": 2, "node_rank": 0, "master_addr": "10.1.0.11", "master_port": 29501, **where}
    with pytest.raises(EngineError) as info:
        launch(shard(profile(**fields), multinode=MultiNode(**mn)))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_api_server_module_cannot_run_a_headless_rank() -> None:
    with pytest.raises(EngineError, match="no headless mode") as info:
        launch(two_nodes(1), {"vllm": API_SERVER})
    assert info.value.field == "multinode.node_rank"


def test_profile_env_may_set_pythonhashseed_without_kv_events() -> None:
    out = launch(shard(profile(env={"PYTHONHASHSEED": "7"})))
    assert out.env == {"CUDA_VISIBLE_DEVICES": GPUS_CSV, "PYTHONHASHSEED": "7", **VLLM_KEY}


# --- SGLang, llama.cpp, sim ------------------------------------------------------------


def test_sglang_tp4_with_lora() -> None:
    prof = profile(engine="sglang", tp=4, adapters=[LoraAdapter(name="sql", path="/loras/sql")])
    out = launch(shard(prof, gpu_uuids=GPUS[:4]))
    assert out.argv == (
        *("python3", "-c", SGLANG_LAUNCHER, "--model-path", MODEL, *LISTEN),
        *("--tp-size", "4", "--served-model-name", NAME),
        *("--lora-paths", "sql=/loras/sql"),
    )
    assert out.env == {"CUDA_VISIBLE_DEVICES": ",".join(GPUS[:4]), **SGLANG_KEY}
    assert out.secret_env == {"LLMGW_ENGINE_API_KEY"}
    assert (out.engine, out.health_path, out.ready_path) == ("sglang", "/health", "/v1/models")
    assert out.listens_http and out.kv_events is None


def test_sglang_two_nodes_rank1_ipv6_master() -> None:
    prof = profile(
        engine="sglang", tp=8, pp=2, gpus_per_node=8, nodes=2, args=["--mem-frac", "0.8"]
    )
    where = MultiNode(nnodes=2, node_rank=1, master_addr="fd00::11", master_port=5000)
    out = launch(shard(prof, multinode=where), {"sglang": ("/venv/bin/python",)})
    assert out.argv == (  # rank 1 serves no HTTP: no key, so the plain module
        *("/venv/bin/python", "-m", "sglang.launch_server", "--model-path", MODEL, *LISTEN),
        *("--tp-size", "8", "--pp-size", "2", "--served-model-name", NAME),
        *("--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "[fd00::11]:5000"),
        *("--mem-frac", "0.8"),
    )
    assert out.env == {"CUDA_VISIBLE_DEVICES": GPUS_CSV}
    assert not out.listens_http


def test_sglang_on_cpu() -> None:
    out = launch(shard(profile(engine="sglang", tp=1, gpu_class="cpu"), gpu_uuids=(), api_key=""))
    assert out.argv == (
        *("python3", "-m", "sglang.launch_server", "--model-path", MODEL, *LISTEN),
        *("--tp-size", "1", "--served-model-name", NAME, "--device", "cpu"),
    )
    assert out.env == {}


def test_llamacpp_on_cpu_with_threads() -> None:
    gguf = "/models/SmolLM2-135M-Instruct-Q8_0.gguf"
    prof = profile(engine="llamacpp", tp=0, gpu_class="cpu", model_path=gguf, cpu_threads=8)
    out = launch(shard(prof, gpu_uuids=()))
    assert out.argv == (
        *("llama-server", "-m", gguf, *LISTEN, "--alias", "SmolLM2-135M-Instruct-Q8_0.gguf"),
        *("--threads", "8", "--metrics"),
    )
    assert out.env == {"LLAMA_API_KEY": "sk-r1"}
    assert out.secret_env == {"LLAMA_API_KEY"}
    assert (out.engine, out.health_path, out.ready_path) == ("llamacpp", "/health", "/v1/models")


def test_llamacpp_on_one_gpu() -> None:
    prof = profile(engine="llamacpp", tp=1, model_path="/m/q.GGUF", served_model_name="q")
    out = launch(shard(prof, gpu_uuids=(MIG,)))
    assert out.argv == ("llama-server", "-m", "/m/q.GGUF", *LISTEN, "--alias", "q", "--metrics")
    assert out.env == {"CUDA_VISIBLE_DEVICES": MIG, "LLAMA_API_KEY": "sk-r1"}


def test_sim_runs_llmgw_sim_engine_with_the_vllm_command_line() -> None:
    spec = shard(profile(tp=1, kv_events=True), gpu_uuids=GPUS[:1])
    sim = launch(shard(profile(engine="sim", tp=1, kv_events=True), gpu_uuids=GPUS[:1]))
    assert sim.argv[:5] == (sys.executable, "-P", "-m", "llmgw", "sim-engine")
    assert sim.engine == "sim"
    as_vllm = launch(spec, {"vllm": ("python", "-P", "-m", "llmgw", "sim-engine")})
    assert sim.argv[5:] == as_vllm.argv[5:]
    assert sim.argv[5:7] == ("serve", MODEL)
    assert (sim.env, sim.kv_events) == (as_vllm.env, as_vllm.kv_events)


def test_registry_names_match_adapters() -> None:
    assert sorted(ADAPTERS) == ["llamacpp", "sglang", "sim", "vllm"]
    assert all(name == adapter.name for name, adapter in ADAPTERS.items())


# --- --engine-bin -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("vllm=vllm", ("vllm", ("vllm",))),
        (
            "vllm=python -m vllm.entrypoints.openai.api_server",
            ("vllm", ("python", "-m", "vllm.entrypoints.openai.api_server")),
        ),
        (
            "vllm=/x/python -m llmgw sim-engine",
            ("vllm", ("/x/python", "-m", "llmgw", "sim-engine")),
        ),
        ("llamacpp='/opt/my build/llama-server'", ("llamacpp", ("/opt/my build/llama-server",))),
        (" sim = python3 -m llmgw sim-engine ", ("sim", ("python3", "-m", "llmgw", "sim-engine"))),
        ("sglang=python=3", ("sglang", ("python=3",))),
    ],
)
def test_parse_engine_bin(text: str, expected: tuple[str, tuple[str, ...]]) -> None:
    assert parse_engine_bin(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tgi=/bin/tgi", "'tgi' is not one of llamacpp, sglang, sim, vllm"),
        ("vllm", "is not ENGINE=CMD"),
        ("=vllm", "is not ENGINE=CMD"),
        ("vllm=", "names no command"),
        ("vllm=  ", "names no command"),
        ("vllm='unterminated", "No closing quotation"),
    ],
)
def test_parse_engine_bin_refusals(text: str, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        parse_engine_bin(text)


@given(st.lists(st.text(st.characters(blacklist_characters="\0"), min_size=1), min_size=1))
def test_parse_engine_bin_undoes_shell_quoting(words: list[str]) -> None:
    assert parse_engine_bin("vllm=" + shlex.join(words)) == ("vllm", tuple(words))


def test_engine_binaries_refuses_an_engine_twice() -> None:
    bins = engine_binaries(["vllm=a b", "sim=c"])
    assert dict(bins.overrides) == {"vllm": ("a", "b"), "sim": ("c",)}
    with pytest.raises(EngineError, match="given twice"):
        engine_binaries(["vllm=a", "vllm=b"])


def test_agent_flag_engine_bin_is_repeatable() -> None:
    args = build_parser().parse_args(
        ["agent", "--engine-bin", "vllm=python -m x", "--engine-bin", "sim=y"]
    )
    assert engine_binaries(args.engine_bin).overrides == {
        "vllm": ("python", "-m", "x"),
        "sim": ("y",),
    }
    assert build_parser().parse_args(["agent"]).engine_bin == []


def test_agent_refuses_an_unknown_engine_bin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["agent", "--state-dir", str(tmp_path), "--engine-bin", "tgi=x", "--discover"])
    assert code == 1
    err = capsys.readouterr().err
    assert "'tgi' is not one of llamacpp, sglang, sim, vllm" in err
