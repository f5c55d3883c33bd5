"""What an engine profile may hand an engine process: environment, arguments, model path.

A profile's ``env``, ``args`` and ``model_path`` reach an engine started by the agent as the
agent's user (root, on most nodes). Unchecked, they are code execution: ``LD_PRELOAD``,
``PYTHONPATH``, ``PYTHONWARNINGS``/``BROWSER``, ``BASH_ENV``, ``PATH``, a plugin library, a
``--port`` that moves the engine off the port the gateway knows. So the control server checks
a profile when it is applied (``llmgw apply``, ``ApplyDeployment`` and its dry run) and before
it starts a shard of a stored one, and the agent checks it again before it launches an engine
(a shard it refuses goes FAILED with the reason; the engine never starts). Both call
:func:`profile_problems`; this module imports nothing of llmgw but the generated messages.

**Environment.** A name is allowed when it is one of :data:`ENV_NAMES` or starts with one of
the engine families of :data:`ENV_FAMILIES`:

=================================  ==========================================================
``VLLM_``                          vLLM (``vllm/envs.py``)
``SGLANG_``, ``SGL_``              SGLang
``LLAMA_``, ``GGML_``              llama.cpp (``LLAMA_ARG_*`` mirror its flags) and ggml
``HF_``, ``HUGGING_FACE_``,        Hugging Face Hub, transformers (``HF_TOKEN``, ``HF_HOME``,
``TRANSFORMERS_``                  ``HF_HUB_OFFLINE`` …)
``NCCL_``                          NCCL
``CUDA_``                          the CUDA runtime and driver
``OMP_``, ``KMP_``, ``MKL_``       OpenMP (GNU and Intel), MKL
``TORCH_``, ``PYTORCH_``           PyTorch
=================================  ==========================================================

plus ``TOKENIZERS_PARALLELISM``, ``NVIDIA_TF32_OVERRIDE``, ``SAFETENSORS_FAST_GPU``,
``DO_NOT_TRACK``, ``PYTHONHASHSEED`` and ``PYTHONUNBUFFERED``. Inside the families, a name
is refused when it makes the engine load code, or files that select code, or write where it
is told (:data:`ENV_DENIED` names each with the reason; for example ``NCCL_NET_PLUGIN``,
``CUDA_INJECTION64_PATH``, ``OMP_TOOL_LIBRARIES``, ``VLLM_LOGGING_CONFIG_PATH``, which
``logging.config.dictConfig`` turns into objects, ``VLLM_ALLOW_INSECURE_SERIALIZATION``,
``VLLM_SERVER_DEV_MODE``). Beyond those, every family name that ends in one of
:data:`ENV_LOADER_SUFFIXES` (``_PATH``, ``_FILE``, ``_DIR``, ``_PLUGIN``, ``_LIBRARIES``,
``_CLS``, ``_MODULE`` …) is refused: such a variable names a file, folder, library or Python
object to load. ``HF_HOME`` (where models are cached) is the one exception.
:data:`MANAGED_ENV` names what the agent sets itself (``CUDA_VISIBLE_DEVICES``, the engines'
API key variables, the multi-node fabric settings; ``PYTHONHASHSEED`` with ``kv_events``).
A value may not hold a NUL, a newline or another control character other than tab.

**Arguments.** No argument holds a control character (tab included). A flag the agent sets
from the profile and shard (``--port``, ``--host``, ``--served-model-name``,
``--tensor-parallel-size``, ``--kv-events-config`` …, :func:`refused_flags` lists them per
engine) or one that loads code or further flags from a file (vLLM ``--config``,
``--log-config-file``, ``--tool-parser-plugin``, ``--worker-cls``, ``--middleware`` …; SGLang
``--enable-custom-logit-processor``) is refused in every spelling the engine accepts:
``--flag``, ``--flag=value``, ``--flag_name`` and dotted sub-keys for vLLM, and for the
engines that parse with argparse (vLLM, SGLang, the simulator), which takes any unique prefix
of a long option, every abbreviation (``--po 1234`` is ``--port 1234``) and a short flag with
its value attached (``-n2``). A prefix that is itself an engine flag (vLLM's ``-dp`` and
``--reasoning-parser``) is kept.

**What the engine can do** (:func:`engine_problems`): KV events only from vLLM and the
simulator, no LoRA adapters on llama.cpp, llama.cpp as one process (TP, PP and nodes 1) of a
``*.gguf`` model. The agent's adapters refuse the same, through this function.

**Names and paths.** ``model_path`` (a positional argument of ``vllm serve``), the served
model name and adapter names and paths may not start with ``-`` (argparse would read them as
a flag) and hold no control character.

Not covered: what a model itself runs. ``--trust-remote-code`` runs Python that ships with
the model at ``model_path``; the operator who applies a profile chooses that model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from llmgw.api.llmgw.v1 import EngineProfile

__all__ = [
    "ARGPARSE_ENGINES", "ENV_DENIED", "ENV_FAMILIES", "ENV_LOADER_SUFFIXES", "ENV_NAMES",
    "MANAGED_ENV", "Problem", "arg_problem", "describe", "engine_problems", "env_problem",
    "managed_env",
    "profile_problems", "refused_flags", "text_problem",
]  # fmt: skip

Problem = tuple[tuple[str | int, ...], str]
"""A key path inside the profile (``("env", "LD_PRELOAD")``, ``("args", 3)``) and what is
wrong there."""

ENV_FAMILIES: Final = (
    *("VLLM_", "SGLANG_", "SGL_", "LLAMA_", "GGML_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_"),
    *("NCCL_", "CUDA_", "OMP_", "KMP_", "MKL_", "TORCH_", "PYTORCH_"),
)
ENV_NAMES: Final = frozenset(
    {
        *("TOKENIZERS_PARALLELISM", "NVIDIA_TF32_OVERRIDE", "SAFETENSORS_FAST_GPU"),
        *("PYTHONHASHSEED", "PYTHONUNBUFFERED", "DO_NOT_TRACK"),
    }
)
ENV_LOADER_SUFFIXES: Final = (
    *("_PATH", "_FILE", "_DIR", "_DIRECTORY", "_ROOT", "_HOME", "_PLUGIN", "_LIB"),
    *("_LIBRARY", "_LIBRARIES", "_SO", "_MODULE", "_CLS", "_CLASS", "_PACKAGE"),
)
_LOADER_ALLOWED = frozenset({"HF_HOME"})  # the model cache: data, and the usual knob

_LOADS_CODE = "loads code"
ENV_DENIED: Final[Mapping[str, str]] = MappingProxyType(
    {
        "VLLM_LOGGING_STREAM": "names a Python object (ext://…) that logging imports",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "lets vLLM's processes unpickle what they receive",
        "VLLM_SERVER_DEV_MODE": "opens vLLM's development endpoints (collective_rpc …) to "
        "every API client",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "lets API clients load adapters from any path",
        "VLLM_USAGE_STATS_SERVER": "sends the node's facts to a server of the profile's choice",
        "HF_MODULES_CACHE": "is where transformers imports remote code from",
        "TORCH_LOGS_OUT": "writes a file where it is told",
        "TORCH_TRACE": "writes files where it is told",
        "TORCH_EXTENSIONS_DIR": f"{_LOADS_CODE}: compiled extensions are loaded from it",
        "CUDA_INJECTION64_PATH": f"{_LOADS_CODE}: a library the CUDA driver loads",
        "CUDA_INJECTION32_PATH": f"{_LOADS_CODE}: a library the CUDA driver loads",
        "NCCL_NET_PLUGIN": f"{_LOADS_CODE}: a network plugin library",
        "NCCL_TUNER_PLUGIN": f"{_LOADS_CODE}: a tuner plugin library",
        "NCCL_PROFILER_PLUGIN": f"{_LOADS_CODE}: a profiler plugin library",
        "NCCL_ENV_PLUGIN": f"{_LOADS_CODE}: an environment plugin library",
        "OMP_TOOL_LIBRARIES": f"{_LOADS_CODE}: OpenMP tool libraries",
        "VLLM_LOGGING_CONFIG_PATH": f"{_LOADS_CODE}: a dictConfig file, whose entries name "
        "classes and callables to build",
    }
)
_KEY_REASON = "the agent sets it from the replica's API key"
_FABRIC_REASON = "the agent sets it from the multi-node placement"
_FLAG_REASON = "the agent sets the llama-server flag it stands for"
MANAGED_ENV: Final[Mapping[str, str]] = MappingProxyType(
    {
        "CUDA_VISIBLE_DEVICES": "the agent sets it from the shard's GPUs",
        **dict.fromkeys(("VLLM_API_KEY", "LLAMA_API_KEY", "LLMGW_ENGINE_API_KEY"), _KEY_REASON),
        **dict.fromkeys(
            ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"), _FABRIC_REASON
        ),
        **dict.fromkeys(
            ("LLAMA_ARG_MODEL", "LLAMA_ARG_HOST", "LLAMA_ARG_PORT", "LLAMA_ARG_ALIAS"), _FLAG_REASON
        ),
    }
)
_HASH_SEED_REASON = "the agent sets it to 0 with kv_events on (the gateway hashes with it)"
_MAX_VALUE = 8192

# --- flags --------------------------------------------------------------------------------

ARGPARSE_ENGINES: Final = frozenset({"vllm", "sim", "sglang"})
"""Engines whose parser (argparse) takes any unique prefix of a long option."""

_SET = "is set by llmgw from the profile and shard"
_CODE = "loads code or flags from a file that llmgw cannot check"
_VLLM: Final = (
    *("--model", "--host", "--port", "--api-key", "--served-model-name", "--headless"),
    *("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp"),
    *("--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port"),
    *("--kv-events-config", "--lora-modules"),
)
_VLLM_MULTINODE: Final = ("--distributed-executor-backend", "--data-parallel-backend", "-dpb")
_VLLM_KV: Final = ("--prefix-caching-hash-algo", "--no-enable-prefix-caching")
_VLLM_CODE: Final = (
    *("--config", "--log-config-file", "--tool-parser-plugin", "--reasoning-parser-plugin"),
    *("--io-processor-plugin", "--middleware", "--worker-cls", "--worker-extension-cls"),
    *("--scheduler-cls", "--logits-processors", "--allowed-local-media-path"),
)
_SGLANG: Final = (
    *("--model-path", "--model", "--host", "--port", "--served-model-name", "--api-key"),
    *("--tp-size", "--tp", "--tensor-parallel-size", "--pp-size", "--pipeline-parallel-size"),
    *("--nnodes", "--node-rank", "--dist-init-addr", "--nccl-init-addr", "--lora-paths"),
    "--device",
)
_SGLANG_CODE: Final = ("--config", "--enable-custom-logit-processor")
_LLAMACPP: Final = (
    *("-m", "--model", "--host", "--port", "-a", "--alias", "--api-key", "--api-key-file"),
)
# Flags of an engine that are prefixes of a refused one: argparse takes them as themselves.
_VLLM_OWN_PREFIXES: Final = frozenset({"-dp", "--reasoning-parser"})
_OWN_PREFIXES: Final[Mapping[str, frozenset[str]]] = MappingProxyType(
    {"vllm": _VLLM_OWN_PREFIXES, "sim": _VLLM_OWN_PREFIXES}
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_TAB = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def refused_flags(engine: str, *, kv_events: bool, multinode: bool) -> Mapping[str, str]:
    """The flags a profile of ``engine`` may not pass, each with the reason."""
    if engine in ("vllm", "sim"):
        managed = (
            *_VLLM,
            *(_VLLM_MULTINODE if multinode else ()),
            *(_VLLM_KV if kv_events else ()),
        )
        return {**dict.fromkeys(managed, _SET), **dict.fromkeys(_VLLM_CODE, _CODE)}
    if engine == "sglang":
        return {**dict.fromkeys(_SGLANG, _SET), **dict.fromkeys(_SGLANG_CODE, _CODE)}
    if engine == "llamacpp":
        return dict.fromkeys(_LLAMACPP, _SET)
    return {}


def text_problem(text: str, *, tab: bool = False) -> str | None:
    """Why ``text`` cannot go into a command line or an environment, or None."""
    found = (_CONTROL_BUT_TAB if tab else _CONTROL).search(text)
    if found is None:
        return None
    what = {"\0": "a NUL", "\n": "a newline", "\r": "a carriage return"}.get(found[0])
    return f"must not hold {what or f'a control character (U+{ord(found[0]):04X})'}"


def arg_problem(engine: str, arg: str, refused: Mapping[str, str]) -> str | None:
    """Why ``arg`` may not be one of a profile's args for ``engine``, or None."""
    if why := text_problem(arg):
        return why
    if not arg.startswith("-") or arg == "-" or arg == "--":
        return None
    flag = _flag_name(engine, arg)
    if flag in refused:
        return f"{flag} {refused[flag]}"
    if engine not in ARGPARSE_ENGINES or flag in _OWN_PREFIXES.get(engine, ()):
        return None
    for name, why in refused.items():
        if name.startswith(flag) and len(flag) > (2 if name.startswith("--") else 1):
            return f"{flag} abbreviates {name}, and {name} {why}"
        if len(name) == 2 and name[1] != "-" and arg.startswith(name) and arg[1] != "-":
            return f"{arg} is {name} with its value attached, and {name} {why}"
    return None


def _flag_name(engine: str, arg: str) -> str:
    """The option ``arg`` names, as the engine reads it (``--a_b=1`` → ``--a-b``)."""
    name = arg.split("=", 1)[0]
    if engine in ("vllm", "sim") and name.startswith("--"):
        name = name.split(".", 1)[0].replace("_", "-")
    return name


def managed_env(*, kv_events: bool) -> Mapping[str, str]:
    """The variables the agent sets for an engine, each with the reason a profile may not."""
    if not kv_events:
        return MANAGED_ENV
    return {**MANAGED_ENV, "PYTHONHASHSEED": _HASH_SEED_REASON}


def env_problem(name: str, value: str, *, kv_events: bool = False) -> str | None:
    """Why a profile may not set ``name`` to ``value``, or None (see the module docstring)."""
    if not _ENV_NAME.fullmatch(name):
        return "not an environment variable name (letters, digits and _, not first a digit)"
    if why := managed_env(kv_events=kv_events).get(name):
        return f"must not be set by a profile: {why}"
    if why := ENV_DENIED.get(name):
        return f"refused: it {why}"
    if name not in ENV_NAMES and not name.startswith(ENV_FAMILIES):
        return (
            "not a variable engines read; a profile may set names of the engine families "
            f"({', '.join(f + '*' for f in ENV_FAMILIES)}) and "
            f"{', '.join(sorted(ENV_NAMES))} (see llmgw/engineinput.py)"
        )
    if name.endswith(ENV_LOADER_SUFFIXES) and name not in _LOADER_ALLOWED:
        return "refused: it names a file, folder, library or object that the engine loads"
    if len(value) > _MAX_VALUE:
        return f"value longer than {_MAX_VALUE:,} characters"
    if why := text_problem(value, tab=True):
        return f"value {why}"
    return None


def _name_problem(text: str) -> str | None:
    """Why ``text`` cannot be a word of a command line that is not a flag, or None."""
    if text.startswith("-"):
        return "must not start with '-' (the engine would read it as a flag)"
    return text_problem(text)


def profile_problems(profile: EngineProfile, *, multinode: bool = False) -> list[Problem]:
    """Every reason ``profile`` cannot be handed to its engine, by key path; [] when none.

    ``multinode`` counts as set when ``profile.nodes`` is above 1.
    """
    problems: list[Problem] = []
    for key, path in (("model_path", profile.model_path),
                      ("served_model_name", profile.served_model_name)):  # fmt: skip
        if path and (why := _name_problem(path)):
            problems.append(((key,), why))
    kv = profile.kv_events
    env = ((name, env_problem(name, profile.env[name], kv_events=kv)) for name in profile.env)
    problems += [(("env", name), why) for name, why in sorted(env) if why]
    problems += _args_problems(profile, multinode=multinode or profile.nodes > 1)
    for i, adapter in enumerate(profile.adapters):
        for key, text in (("name", adapter.name), ("path", adapter.path)):
            if why := _name_problem(text):
                problems.append((("adapters", i, key), why))
    return problems + engine_problems(profile)


_KV_ENGINES: Final = frozenset({"vllm", "sim"})
_ADAPTER_ENGINES: Final = frozenset({"vllm", "sim", "sglang"})


def engine_problems(profile: EngineProfile) -> list[Problem]:
    """What ``profile`` asks of its engine that the engine cannot do, by key path; [] when
    none. The agent's adapters refuse exactly these (``llmgw.agent.engines``), and the
    server refuses them at apply, so no profile is stored that no agent would start."""
    problems: list[Problem] = []
    engine = profile.engine
    if profile.kv_events and engine not in _KV_ENGINES:
        problems.append((("kv_events",), "only the vllm and sim engines publish KV events"))
    if profile.adapters and engine not in _ADAPTER_ENGINES:
        problems.append((("adapters",), "LoRA adapters are served by the vllm and sim engines"))
    if engine == "llamacpp":
        for key, value in (("tp", profile.tp), ("pp", profile.pp), ("nodes", profile.nodes)):
            if value > 1:
                problems.append(
                    ((key,), f"llama.cpp runs one process on one node; must be 1, got {value}")
                )
        model = profile.model_path
        if model and not model.lower().endswith(".gguf"):
            problems.append((("model_path",), f"{model!r} is not a GGUF file (*.gguf)"))
    return problems


def _args_problems(profile: EngineProfile, *, multinode: bool) -> Iterable[Problem]:
    refused = refused_flags(profile.engine, kv_events=profile.kv_events, multinode=multinode)
    for i, arg in enumerate(profile.args):
        if why := arg_problem(profile.engine, arg, refused):
            yield ("args", i), why


def describe(problems: Sequence[Problem]) -> str:
    """The problems in one line: ``env.LD_PRELOAD: …; args[2]: …``."""
    return "; ".join(f"{_dotted(path)}: {why}" for path, why in problems)


def _dotted(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out
