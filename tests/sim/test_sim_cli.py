"""``llmgw sim-engine``'s command line: vLLM's flags as the adapter writes them, refusals."""

from __future__ import annotations

import json

import pytest
from simhelpers import sim_config

from llmgw.cli.main import build_parser, main
from llmgw.cli.simengine import config_from_args
from llmgw.sim.engine import SimConfigError, SimEngineConfig, SimStartError, running_engine

KV = json.dumps(
    {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///state/kv/r1-s0.pub",
        "replay_endpoint": "ipc:///state/kv/r1-s0.replay",
        "topic": "kv-events",
    },
    separators=(",", ":"),
)
# What the vLLM adapter writes for a two-node TP=8/PP=2 profile with LoRA and KV events.
LEADER = (
    "serve", "/models/llama", "--host", "127.0.0.1", "--port", "8001",
    "--served-model-name", "llama", "--api-key", "sk-r1",
    "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
    "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
    "--max-loras", "2",
    "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "--master-port", "29501",
    "--distributed-executor-backend", "mp", "--data-parallel-backend", "mp",
    "--kv-events-config", KV, "--enable-prefix-caching",
    "--prefix-caching-hash-algo", "sha256_cbor",
)  # fmt: skip
WORKER = (
    "serve", "/models/llama", "--served-model-name", "llama",
    "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
    "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501",
    "--distributed-executor-backend", "mp", "--data-parallel-backend", "mp", "--headless",
)  # fmt: skip


def config_of(*argv: str, env: dict[str, str] | None = None) -> SimEngineConfig:
    return config_from_args(build_parser().parse_args(["sim-engine", *argv]), env or {})


def test_the_adapters_leader_command_line_is_understood() -> None:
    config = config_of(*LEADER, env={"PYTHONHASHSEED": "0"})
    assert config == sim_config(
        *LEADER[2:], model="/models/llama", fast=False, env={"PYTHONHASHSEED": "0"}
    )
    c = sim_config(*LEADER[2:], model="/models/llama", env={"PYTHONHASHSEED": "0"})
    assert (c.model, c.served_model_names, c.http.port, c.http.api_keys) == (
        "/models/llama",
        ("llama",),
        8001,
        ("sk-r1",),
    )
    assert (c.parallel.tensor_parallel_size, c.parallel.pipeline_parallel_size) == (8, 2)
    assert (c.parallel.nnodes, c.parallel.node_rank, c.parallel.master_addr) == (2, 0, "10.0.0.1")
    assert [(m.name, m.path, m.lora_int_id) for m in c.lora_modules] == [
        ("sql", "/adapters/sql", 1),
        ("chat", "/adapters/chat", 2),
    ]
    assert c.kv_events.publishes and c.kv_events.endpoint == "ipc:///state/kv/r1-s0.pub"
    assert (c.kv_events.topic, c.prefix_caching_hash_algo, c.hash_seed) == (
        "kv-events",
        "sha256_cbor",
        "0",
    )
    assert (c.vllm_version, c.kv_event_encoding, c.int_block_hashes) == ("0.32.0", "map", True)


def test_the_adapters_headless_worker_command_line_is_understood() -> None:
    c = sim_config(*WORKER[2:], model="/models/llama")
    assert c.parallel.headless and c.parallel.node_rank == 1


def test_serve_is_optional_and_the_api_server_module_form_works() -> None:
    assert config_of("m").model == config_of("serve", "m").model == "m"
    assert config_of("--model", "/x", "--port", "9").model == "/x"


def test_vllm_short_flags_and_forms_are_accepted() -> None:
    c = sim_config("-tp", "4", "-pp", "2", "-n", "2", "-r", "1", "-O0", "--enforce-eager",
                   "--dtype", "float32", "--seed", "3", "--disable-log-requests",
                   "--uvicorn-log-level", "warning", "--gpu-memory-utilization", "0.5",
                   "--max-model-len", "4k", "--no-enable-prefix-caching")  # fmt: skip
    assert (c.parallel.tensor_parallel_size, c.parallel.node_rank, c.seed) == (4, 1, 3)
    assert (c.max_model_len, c.enable_prefix_caching) == (4000, False)
    assert sim_config("--max-model-len", "4K").max_model_len == 4096


def test_lora_modules_take_the_json_form_too() -> None:
    c = sim_config(
        "--enable-lora",
        "--lora-modules",
        '{"name": "sql", "path": "/a", "base_model_name": "base"}',
    )
    assert (c.lora_modules[0].name, c.lora_modules[0].base_model_name) == ("sql", "base")


def test_the_environment_sets_the_hash_seed_int_hashes_and_api_key() -> None:
    env = {"PYTHONHASHSEED": "7", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0", "VLLM_API_KEY": "k"}
    c = sim_config(env=env)
    assert (c.hash_seed, c.int_block_hashes, c.http.api_keys) == ("7", False, ("k",))
    assert sim_config().hash_seed is None


def test_the_event_encoding_follows_the_version_unless_told() -> None:
    assert sim_config("--sim-vllm-version", "0.23.0").kv_event_encoding == "array"
    assert sim_config("--sim-vllm-version", "0.24.0").kv_event_encoding == "map"
    forced = sim_config("--sim-vllm-version", "0.33.0", "--sim-kv-event-encoding", "array")
    assert forced.kv_event_encoding == "array"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (("--kv-events-config", "{nope"), "not valid JSON"),
        (("--kv-events-config", '{"endpoint": 5}'), "wrong type"),
        (("--kv-events-config", '{"surprise": true}'), "unknown key 'surprise'"),
        (("--kv-events-config", '{"publisher": "kafka"}'), "not zmq"),
        (("--lora-modules", "sql=/a"), "needs --enable-lora"),
        (("--enable-lora", "--lora-modules", "noequals"), "not name=path"),
        (("--enable-lora", "--lora-modules", "a=/x", "a=/y"), "names 'a' twice"),
        (("--sim-vllm-version", "0.9.2"), "0.10.2 and later"),
        (("--sim-vllm-version", "latest"), "not a version"),
        (("--nnodes", "2", "--node-rank", "2"), "--node-rank 2"),
        (("--block-size", "0"), "--block-size"),
        (("--sim-crash-after", "0"), "--sim-crash-after"),
        (("--sim-decode-ms-per-token", "-1"), "must not be negative"),
    ],
)
def test_malformed_values_are_refused_naming_the_flag(flags: tuple[str, ...], needle: str) -> None:
    with pytest.raises(SimConfigError, match=needle):
        sim_config(*flags)


def test_int_hash_environment_must_be_a_number() -> None:
    with pytest.raises(SimConfigError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        sim_config(env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "yes"})


def test_the_model_must_be_given_once() -> None:
    with pytest.raises(SimConfigError, match="no model"):
        config_of("serve")
    with pytest.raises(SimConfigError, match="unexpected arguments: c"):
        config_of("serve", "b", "c")
    with pytest.raises(SimConfigError, match="two models"):
        config_of("a", "--model", "b")


def test_an_unknown_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim-engine", "serve", "m", "--port", "1", "--speculative-magic", "3"])
    assert info.value.code == 2
    assert "--speculative-magic" in capsys.readouterr().err


def test_a_bad_value_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim-engine", "serve", "m", "--lora-modules", "a=/b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmgw: sim-engine: --lora-modules needs --enable-lora")


async def test_an_engine_whose_cache_cannot_hold_one_request_refuses_to_start() -> None:
    config = sim_config("--sim-kv-blocks", "4", "--block-size", "16", "--max-model-len", "100")
    with pytest.raises(SimStartError, match="estimated maximum model length is 64"):
        async with running_engine(config):
            pass
