"""The allowlist of what a profile may hand an engine (llmgw/engineinput.py)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import engineinput
from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter
from llmgw.engineinput import (
    ENV_DENIED,
    ENV_FAMILIES,
    ENV_NAMES,
    MANAGED_ENV,
    arg_problem,
    env_problem,
    profile_problems,
    refused_flags,
)

# --- environment -------------------------------------------------------------------------


@pytest.mark.parametrize("name", [f + "SETTING" for f in ENV_FAMILIES] + sorted(ENV_NAMES))
def test_names_of_the_engine_families_are_allowed(name: str) -> None:
    assert env_problem(name, "1") is None


@pytest.mark.parametrize(
    "name",
    [
        *("VLLM_LOGGING_LEVEL", "VLLM_CPU_KVCACHE_SPACE", "VLLM_ATTENTION_BACKEND"),
        *("NCCL_DEBUG", "NCCL_P2P_DISABLE", "NCCL_NET", "HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE"),
        *("CUDA_DEVICE_MAX_CONNECTIONS", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF"),
        *("TORCH_NCCL_ASYNC_ERROR_HANDLING", "LLAMA_ARG_N_GPU_LAYERS", "SGLANG_LOG_LEVEL"),
        *("TOKENIZERS_PARALLELISM", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "DO_NOT_TRACK"),
    ],
)
def test_settings_operators_use_are_allowed(name: str) -> None:
    assert env_problem(name, "value") is None


@pytest.mark.parametrize(
    "name",
    [
        *("LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONWARNINGS", "PYTHONSTARTUP"),
        *("PYTHONHOME", "BROWSER", "BASH_ENV", "ENV", "PATH", "HOME", "PERL5OPT", "NODE_OPTIONS"),
        *("GCONV_PATH", "LLMGW_ANYTHING", "vllm_logging_level", "NVIDIA_VISIBLE_DEVICES"),
    ],
)
def test_names_outside_the_families_are_refused_naming_the_list(name: str) -> None:
    why = env_problem(name, "x")
    assert why is not None and "not a variable engines read" in why
    assert "llmgw/engineinput.py" in why


@pytest.mark.parametrize(
    "name",
    [
        *sorted(ENV_DENIED),
        *("VLLM_NCCL_SO_PATH", "VLLM_RUST_FRONTEND_PATH", "VLLM_CACHE_ROOT", "HF_TOKEN_PATH"),
        *("NCCL_CONF_FILE", "NCCL_DEBUG_FILE", "TORCH_COMPILE_DEBUG_DIR", "CUDA_HOME"),
        *("CUDA_PATH", "PYTORCH_KERNEL_CACHE_PATH", "SGLANG_TORCH_PROFILER_DIR", "GGML_RPC_LIB"),
        "VLLM_WORKER_CLS",
    ],
)
def test_names_that_load_code_or_write_files_are_refused(name: str) -> None:
    why = env_problem(name, "/tmp/x")
    assert why is not None and why.startswith("refused: it ")


@pytest.mark.parametrize("name", sorted(MANAGED_ENV))
def test_names_the_agent_sets_are_refused_as_managed(name: str) -> None:
    why = env_problem(name, "x")
    assert why is not None and why.startswith("must not be set by a profile: the agent")
    assert MANAGED_ENV[name] in why


def test_the_hash_seed_is_the_agents_only_with_kv_events() -> None:
    assert env_problem("PYTHONHASHSEED", "7") is None
    why = env_problem("PYTHONHASHSEED", "7", kv_events=True)
    assert why is not None and "kv_events" in why


@pytest.mark.parametrize(
    ("value", "said"),
    [("a\0b", "a NUL"), ("a\nb", "a newline"), ("a\rb", "a carriage return"),
     ("\x1b[2K", "a control character (U+001B)"), ("\x7f", "a control character (U+007F)"),
     ("\x85", "a control character (U+0085)")],
)  # fmt: skip
def test_values_with_control_characters_are_refused(value: str, said: str) -> None:
    assert env_problem("VLLM_LOGGING_LEVEL", value) == f"value must not hold {said}"


def test_values_may_hold_tabs_spaces_and_any_printable_text() -> None:
    assert env_problem("NCCL_DEBUG_SUBSYS", "INIT,\tNET é 🙂") is None
    assert env_problem("HF_TOKEN", "x" * 8193) == "value longer than 8,192 characters"


# --- arguments ---------------------------------------------------------------------------

VLLM = refused_flags("vllm", kv_events=True, multinode=True)


@pytest.mark.parametrize(
    ("arg", "said"),
    [
        ("--port", "--port is set by llmgw"),
        ("--port=1", "--port is set by llmgw"),
        ("--served_model_name", "--served-model-name is set by llmgw"),
        ("--kv-events-config.endpoint=tcp://*:1", "--kv-events-config is set by llmgw"),
        ("--po", "--po abbreviates --port, and --port is set by llmgw"),
        ("--ho=0.0.0.0", "--ho abbreviates --host"),
        ("--api-k", "--api-k abbreviates --api-key"),
        ("-t", "-t abbreviates -tp"),
        ("-n2", "-n2 is -n with its value attached"),
        ("-r1", "-r1 is -r with its value attached"),
        ("--no-enable-prefix", "--no-enable-prefix abbreviates --no-enable-prefix-caching"),
        ("--config", "--config loads code or flags from a file"),
        ("--tool-parser-plug", "abbreviates --tool-parser-plugin, and --tool-parser-plugin loads"),
        ("--worker-extension-cls", "loads code"),
        ("--log-config-file=/tmp/x.json", "loads code"),
    ],
)
def test_vllm_flags_the_agent_sets_or_that_load_code_are_refused(arg: str, said: str) -> None:
    why = arg_problem("vllm", arg, VLLM)
    assert why is not None and said in why


@pytest.mark.parametrize(
    "arg",
    [
        *("--max-model-len", "--max_model_len=8192", "-O0", "-q", "-dp", "--dtype=float32"),
        *("--reasoning-parser", "--trust-remote-code", "--enable-lora", "8192", "-", "--"),
        "--kv-cache-dtype",
    ],
)
def test_other_vllm_flags_pass(arg: str) -> None:
    assert arg_problem("vllm", arg, VLLM) is None


def test_kv_and_multinode_flags_are_managed_only_when_the_agent_sets_them() -> None:
    plain = refused_flags("vllm", kv_events=False, multinode=False)
    for flag in ("--prefix-caching-hash-algo", "--distributed-executor-backend"):
        assert flag in VLLM and flag not in plain


def test_llamacpp_takes_no_abbreviations_so_only_exact_flags_are_refused() -> None:
    refused = refused_flags("llamacpp", kv_events=False, multinode=False)
    for arg in ("-m", "--model=x", "--port", "-a", "--api-key-file"):
        assert arg_problem("llamacpp", arg, refused) is not None, arg
    for arg in ("-mg", "--po", "-ngl", "--alias_x", "-md"):
        assert arg_problem("llamacpp", arg, refused) is None, arg


def test_sglang_refuses_its_own_flags_and_abbreviations() -> None:
    refused = refused_flags("sglang", kv_events=False, multinode=False)
    for arg in ("--model-path", "--tp-size=2", "--dist-init", "--enable-custom-logit-processor"):
        assert arg_problem("sglang", arg, refused) is not None, arg
    assert arg_problem("sglang", "--mem-fraction-static", refused) is None


@pytest.mark.parametrize("arg", ["--max-model-len\n--port", "a\0", "\x1b]52;c;x\x07", "a\tb"])
def test_args_with_control_characters_are_refused(arg: str) -> None:
    why = arg_problem("llamacpp", arg, {})
    assert why is not None and why.startswith("must not hold")


def _argparse_engine() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """A parser as vLLM builds it (argparse, abbreviations on) with the refused flags and
    others, and the dest of each refused flag."""
    parser = argparse.ArgumentParser(add_help=False)
    dests: dict[str, str] = {}
    for flag in VLLM:
        action = parser.add_argument(flag, dest=f"refused{len(dests)}")
        dests[action.dest] = flag
    for flag in ("-dp", "--reasoning-parser", "--max-model-len", "--dtype", "-q", "-O"):
        parser.add_argument(flag)
    return parser, dests


PARSER, REFUSED_DESTS = _argparse_engine()
FLAG_TEXT = st.one_of(
    st.sampled_from(sorted(VLLM)).flatmap(
        lambda f: st.integers(1, len(f)).map(lambda n: f[:n])
    ),  # every prefix of a refused flag
    st.from_regex(r"--?[a-z][-a-z]{0,12}", fullmatch=True),
)


@given(FLAG_TEXT, st.sampled_from(["", "=1", "1"]))
def test_any_argument_argparse_reads_as_a_refused_flag_is_refused(flag: str, tail: str) -> None:
    arg = flag + tail
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed, _ = PARSER.parse_known_args([arg, "1"])
    except SystemExit:
        return  # argparse refuses it (ambiguous, or a value missing): the engine would too
    hit = [REFUSED_DESTS[d] for d, v in vars(parsed).items() if d in REFUSED_DESTS and v]
    if hit:
        assert arg_problem("vllm", arg, VLLM) is not None, (arg, hit)


# --- profiles ----------------------------------------------------------------------------


def test_profile_problems_name_every_key_path() -> None:
    profile = EngineProfile(
        name="p",
        engine="vllm",
        model_path="--port=1",
        served_model_name="-x",
        args=["--dtype", "float16", "--po", "1"],
        env={"LD_PRELOAD": "/x.so", "VLLM_LOGGING_LEVEL": "a\nb"},
        adapters=[LoraAdapter("--port", "1")],
    )
    assert [path for path, _ in profile_problems(profile)] == [
        ("model_path",),
        ("served_model_name",),
        ("env", "LD_PRELOAD"),
        ("env", "VLLM_LOGGING_LEVEL"),
        ("args", 2),
        ("adapters", 0, "name"),
    ]
    text = engineinput.describe(profile_problems(profile)[:1])
    assert text == "model_path: must not start with '-' (the engine would read it as a flag)"


def test_a_good_profile_has_no_problems() -> None:
    profile = EngineProfile(
        name="p",
        engine="vllm",
        model_path="/models/chat",
        args=["--max-model-len", "8192"],
        env={"VLLM_LOGGING_LEVEL": "INFO", "HF_TOKEN": "hf_x"},
        adapters=[LoraAdapter("sql", "/loras/sql")],
    )
    assert profile_problems(profile) == []


def test_a_multinode_profile_manages_the_multinode_flags() -> None:
    args = ["--distributed-executor-backend", "ray"]
    single = EngineProfile(name="p", engine="vllm", model_path="/m", nodes=1, args=args)
    double = EngineProfile(name="p", engine="vllm", model_path="/m", nodes=2, args=args)
    assert profile_problems(single) == []
    assert [p for p, _ in profile_problems(double)] == [("args", 0)]


def test_engine_problems_name_what_the_engine_cannot_do() -> None:
    from llmgw.api.llmgw.v1 import EngineProfile, LoraAdapter
    from llmgw.engineinput import engine_problems, profile_problems

    llama = EngineProfile(name="l", engine="llamacpp", tp=2, model_path="/m/x.bin",
                          kv_events=True, adapters=[LoraAdapter("a", "/a")])  # fmt: skip
    assert [path for path, _ in engine_problems(llama)] == [
        ("kv_events",), ("adapters",), ("tp",), ("model_path",),
    ]  # fmt: skip
    assert all(p in profile_problems(llama) for p in engine_problems(llama))  # apply refuses them
    sglang = EngineProfile(
        name="s", engine="sglang", kv_events=True, adapters=[LoraAdapter("a", "/a")]
    )
    assert engine_problems(sglang) == [
        (("kv_events",), "only the vllm and sim engines publish KV events")
    ]
    vllm = EngineProfile(name="v", engine="vllm", tp=8, kv_events=True, model_path="/m/x")
    assert engine_problems(vllm) == []
