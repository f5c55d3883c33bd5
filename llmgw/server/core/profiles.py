"""Engine profiles and deployments as operators write them: TOML in, checked messages out.

A document holds two tables, both optional::

    [profiles.chat-tp2]
    engine = "sim"                  # required: vllm | sglang | llamacpp | sim
    gpu_class = "H100"              # required: the class placement matches; "cpu" = no GPU
    tp = 2                          # tensor parallel size, default 1
    pp = 1                          # pipeline parallel size, default 1
    nodes = 1                       # nodes one replica spans, default 1
    gpus_per_node = 2               # default tp * pp / nodes
    model_path = "/models/chat"     # required
    served_model_name = "chat"      # default: the last component of model_path
    kv_events = true                # default false
    args = ["--max-model-len", "8192"]
    env = { VLLM_LOGGING_LEVEL = "INFO" }
    adapters = { sql = "/loras/sql" }   # LoRA name = path; or [[profiles.X.adapters]] tables
    cpu_threads = 8                 # required (> 0) for gpu_class "cpu"; optional otherwise
    min_gpu_memory = "40GiB"        # per GPU, placement only; GB is 10**9 bytes, GiB 2**30

    [deployments.chat]
    profile = "chat-tp2"            # required: a profile of this same document
    replicas = 2                    # 0 to 10,000, default 1
    pool = "gpu-a"                  # default: any pool
    labels = { zone = "eu-1" }      # node labels a replica's nodes must carry
    priority = 0                    # under a pool's GPU budget a higher one goes first

    [deployments.chat.autoscale]    # optional: the autoscaler sets the count
    min = 1
    max = 8
    ttft_p90_ms = 800

``llmgw.server.core.deployment_keys`` reads a deployment and says every key and rule of its
table and of its autoscale policy.

Rules beyond types: names are DNS labels (``[a-z0-9]([-a-z0-9.]*[a-z0-9])?``, at most 63
characters; quote a dotted one, ``[profiles."chat.v2"]``); ``tp * pp == gpus_per_node *
nodes``; a ``cpu`` profile has tp, pp and nodes 1, gpus_per_node 0, no min_gpu_memory and a
positive cpu_threads; llama.cpp has no tensor or pipeline parallelism and runs on one node;
``env``, ``args`` and ``model_path`` pass :func:`llmgw.engineinput.profile_problems`: env
names of the engine families only (``VLLM_*``, ``NCCL_*``, ``HF_*`` …; never one that loads
code, such as ``LD_PRELOAD`` or ``NCCL_NET_PLUGIN``, and never one the agent sets, such as
``CUDA_VISIBLE_DEVICES``), no flag the agent sets (``--port`` …) in any spelling the engine
accepts, no control characters; an adapter's name is unique and differs from the served
model name.

:func:`parse_document` refuses a bad document whole, with every problem named by its key
path (:class:`~llmgw.server.errors.ProfileError`); nothing partial is returned. Each
profile comes back with every default filled in, so equal documents give equal messages.
:func:`render_document` writes a document back as TOML that parses to the same document.
``llmgw.server.core.fingerprint`` hashes what of a profile changes the running engine process.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

from llmgw import engineinput
from llmgw.api.llmgw.v1 import Deployment, EngineProfile, LoraAdapter
from llmgw.server.core.deployment_keys import MAX_REPLICAS, read_deployment, render_deployment
from llmgw.server.core.tomlkeys import (
    NAME,
    NAME_MAX,
    NAME_RULE,
    Table,
    bad_text,
    key_path,
    render_table,
    show,
)
from llmgw.server.errors import ProfileError

__all__ = [
    "CPU_CLASS", "ENGINES", "MAX_REPLICAS", "Document", "parse_document", "render_document",
]  # fmt: skip

ENGINES = frozenset({"vllm", "sglang", "llamacpp", "sim"})
CPU_CLASS = "cpu"  # gpu_class asking for no GPU
_MAX_PARALLEL = 1024  # tp, pp and nodes
_MAX_GPUS_PER_NODE = 64
_MAX_CPU_THREADS = 4096
_MAX_GPU_MEMORY = 1 << 50  # 1 PiB: more than any GPU has
_MAX_TEXT = 256  # gpu_class, served model and adapter names, label keys
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

_TOP_KEYS = ("profiles", "deployments")
_PROFILE_KEYS = (
    "engine", "gpu_class", "tp", "pp", "gpus_per_node", "nodes", "model_path",
    "served_model_name", "kv_events", "args", "env", "adapters", "cpu_threads",
    "min_gpu_memory",
)  # fmt: skip
_ADAPTER_KEYS = ("name", "path")


@dataclass(frozen=True, slots=True)
class Document:
    """A checked document: profiles and deployments by name, in the order written.

    The messages are shared, not copied: treat them as read-only.
    """

    profiles: Mapping[str, EngineProfile]
    deployments: Mapping[str, Deployment]


def parse_document(text: str, *, source: str = "<input>") -> Document:
    """The document in ``text``; :class:`ProfileError` naming every problem if it is bad.

    ``source`` (a file name, usually) prefixes each problem in the error's message.
    """
    try:
        data = tomllib.loads(text)
    except ValueError as exc:  # TOMLDecodeError, or an integer too long for int()
        raise ProfileError((f"TOML syntax: {exc}",), source=source) from exc
    except RecursionError as exc:  # tomllib recurses once per nested array or table
        raise ProfileError(("TOML syntax: nested too deeply",), source=source) from exc
    problems: list[str] = []
    document = _read_document(data, problems)
    if problems:
        raise ProfileError(tuple(problems), source=source)
    return document


# -- reading -------------------------------------------------------------------------------


def _tables(data: dict[str, Any], key: str, problems: list[str]) -> Iterator[tuple[str, Table]]:
    """The named sub-tables of ``data[key]``, each name checked."""
    section = data.get(key, {})
    if not isinstance(section, dict):
        problems.append(f"{key}: must be a table, got {show(section)}")
        return
    for name, body in section.items():
        if not NAME.fullmatch(name) or len(name) > NAME_MAX:
            problems.append(f"{key_path(key, name)}: not a valid name: {NAME_RULE}")
        if not isinstance(body, dict):
            problems.append(f"{key_path(key, name)}: must be a table, got {show(body)}")
            continue
        yield name, Table(body, (key, name), problems)


def _read_document(data: dict[str, Any], problems: list[str]) -> Document:
    Table(data, (), problems).check_keys(_TOP_KEYS)
    profiles: dict[str, EngineProfile] = {}
    for name, table in _tables(data, "profiles", problems):
        profile = _read_profile(name, table)
        if profile is not None:
            profiles[name] = profile
    raw = data.get("profiles")
    known = sorted(raw) if isinstance(raw, dict) else []
    deployments: dict[str, Deployment] = {}
    for name, table in _tables(data, "deployments", problems):
        deployment = read_deployment(name, table, known)
        if deployment is not None:
            deployments[name] = deployment
    return Document(MappingProxyType(profiles), MappingProxyType(deployments))


def _read_profile(name: str, t: Table) -> EngineProfile | None:
    before = len(t.problems)
    t.check_keys(_PROFILE_KEYS)
    engine, gpu_class = t.string("engine"), t.string("gpu_class")
    if engine is not None and engine not in ENGINES:
        t.problem("engine", f"must be one of {', '.join(sorted(ENGINES))}, got {show(engine)}")
    if gpu_class is not None and gpu_class != CPU_CLASS and gpu_class.lower() == CPU_CLASS:
        t.problem("gpu_class", f'write "cpu" in lower case, got {show(gpu_class)}')
    elif gpu_class is not None and not _is_gpu_class(gpu_class):
        t.problem("gpu_class", f'must be a GPU class such as "H100", got {show(gpu_class)}')
    cpu = gpu_class == CPU_CLASS
    shape = _read_parallelism(t, cpu=cpu, llamacpp=engine == "llamacpp")
    model_path = t.string("model_path")
    served = _read_served_name(t, model_path)
    if not isinstance(kv_events := t.data.get("kv_events", False), bool):
        t.problem("kv_events", f"must be true or false, got {show(kv_events)}")
    profile = EngineProfile(
        name=name,
        engine=engine or "",
        gpu_class=gpu_class or "",
        model_path=model_path or "",
        served_model_name=served or "",
        kv_events=kv_events is True,
        args=t.strings("args") or [],
        env=t.string_table("env", _env_key_check(kv_events=kv_events is True)) or {},
        adapters=_read_adapters(t, served),
        cpu_threads=_read_cpu_threads(t, cpu=cpu),
        min_gpu_memory_bytes=_read_min_memory(t, cpu=cpu),
    )
    if shape is not None:
        profile.tp, profile.pp, profile.gpus_per_node, profile.nodes = shape
    found = set(t.problems[before:])  # env names were checked as the table was read
    for path, why in engineinput.profile_problems(profile):
        if (problem := f"{key_path(*t.path, *path)}: {why}") not in found:
            t.problems.append(problem)
    return profile if len(t.problems) == before else None


def _is_gpu_class(text: str) -> bool:
    return len(text) <= _MAX_TEXT and text == text.strip() and text.isprintable()


def _read_parallelism(t: Table, *, cpu: bool, llamacpp: bool) -> tuple[int, int, int, int] | None:
    """``(tp, pp, gpus_per_node, nodes)`` with defaults filled in, or None on a problem."""
    tp = t.integer("tp", 1, _MAX_PARALLEL, 1)
    pp = t.integer("pp", 1, _MAX_PARALLEL, 1)
    nodes = t.integer("nodes", 1, _MAX_PARALLEL, 1)
    per_node = t.integer("gpus_per_node", 0 if cpu else 1, _MAX_GPUS_PER_NODE, 0 if cpu else 1)
    if tp is None or pp is None or nodes is None or per_node is None:
        return None
    if cpu:
        return _cpu_parallelism(t, tp, pp, nodes, per_node)
    if llamacpp:
        for key, value in (("tp", tp), ("pp", pp), ("nodes", nodes)):
            if value != 1:
                t.problem(key, f"llama.cpp runs one process on one node; must be 1, got {value}")
    world = tp * pp
    if "gpus_per_node" in t.data and per_node * nodes != world:
        why = f"× nodes = {per_node} × {nodes} must equal tp × pp = {tp} × {pp}"
        t.problem("gpus_per_node", "gpus_per_node " + why)
        return None
    if "gpus_per_node" not in t.data and (world % nodes or world > nodes * _MAX_GPUS_PER_NODE):
        why = f"tp × pp = {world} GPUs do not split over {nodes} node(s), {_MAX_GPUS_PER_NODE}"
        t.problem("nodes", why + " at most on each")
        return None
    per_node = per_node if "gpus_per_node" in t.data else world // nodes
    return tp, pp, per_node, nodes


def _cpu_parallelism(t: Table, *sizes: int) -> tuple[int, int, int, int] | None:
    """``tp, pp, nodes, gpus_per_node`` must be 1, 1, 1 and 0 (set or not)."""
    keys, wanted = ("tp", "pp", "nodes", "gpus_per_node"), (1, 1, 1, 0)
    bad = [(k, v, w) for k, v, w in zip(keys, sizes, wanted, strict=True) if v != w]
    for key, value, want in bad:
        t.problem(key, f'must be {want} (or unset) when gpu_class is "cpu", got {value}')
    return None if bad else (1, 1, 0, 1)


def _read_served_name(t: Table, model_path: str | None) -> str | None:
    if "served_model_name" in t.data:
        name = t.string("served_model_name")
    elif model_path is None:
        return None
    else:
        name = PurePosixPath(model_path).name
        if not name:
            t.problem("served_model_name", f"required: model_path {show(model_path)} names none")
            return None
    if name is not None and (why := _model_name_problem(name)):
        t.problem("served_model_name", why)
        return None
    return name


def _model_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model name that requests select, or None."""
    if len(name) <= _MAX_TEXT and all(c.isprintable() and not c.isspace() for c in name):
        return None
    return f"must be printable, no spaces, at most {_MAX_TEXT} characters, got {show(name)}"


def _env_key_check(*, kv_events: bool) -> Callable[[str], str | None]:
    """What is wrong with an env name, before its value is known (see engineinput)."""
    return lambda key: engineinput.env_problem(key, "", kv_events=kv_events)


def _read_adapters(t: Table, served: str | None) -> list[LoraAdapter]:
    """Either form: ``{ name = "path" }``, or an array of ``{ name, path }`` tables."""
    value = t.data.get("adapters", [])
    items: list[tuple[str | int, object, object]] = []
    if isinstance(value, dict):
        items = [(name, name, path) for name, path in value.items()]
    elif isinstance(value, list):
        items = [(i, *_adapter_item(t, i, item)) for i, item in enumerate(value)]
    else:
        t.problem("adapters", f"must be a table or an array of tables, got {show(value)}")
    adapters: list[LoraAdapter] = []
    seen: set[str] = set()
    for key, name, path in items:
        if name is None:  # the array item was not a table; already said
            continue
        why = _adapter_problem(name, path, seen, served)
        if why:
            t.problem("adapters", why, key)
        elif isinstance(name, str) and isinstance(path, str):
            adapters.append(LoraAdapter(name=name, path=path))
        seen.add(str(name))
    return adapters


def _adapter_item(t: Table, index: int, item: object) -> tuple[object, object]:
    if not isinstance(item, dict):
        t.problem("adapters", f"must be a table {{ name, path }}, got {show(item)}", index)
        return None, None
    Table(item, (*t.path, "adapters", index), t.problems).check_keys(_ADAPTER_KEYS)
    return item.get("name", ""), item.get("path", "")


def _adapter_problem(name: object, path: object, seen: set[str], served: str | None) -> str | None:
    if not isinstance(name, str) or not name:
        return f"needs a name, a non-empty string; got {show(name)}"
    if why := _model_name_problem(name) or bad_text(name):
        return f"adapter name: {why}"
    if name in seen:
        return f"two adapters are named {show(name)}"
    if name == served:
        return f"adapter name {show(name)} is the served model name too"
    if not isinstance(path, str) or not path:
        return f"needs a path, a non-empty string; got {show(path)}"
    return bad_text(path)


def _read_cpu_threads(t: Table, *, cpu: bool) -> int:
    threads = t.integer("cpu_threads", 0, _MAX_CPU_THREADS, 0)
    if cpu and threads == 0:
        t.problem("cpu_threads", 'required, a positive integer, when gpu_class is "cpu"')
    return threads or 0


def _read_min_memory(t: Table, *, cpu: bool) -> int:
    """``min_gpu_memory`` in bytes: an integer, or a size such as "40GiB" or "80GB"."""
    value = t.data.get("min_gpu_memory", 0)
    size = _size_bytes(value)
    if size is None or not 0 <= size <= _MAX_GPU_MEMORY:
        why = f'must be bytes or a size such as "40GiB" or "80GB", up to 1 PiB; got {show(value)}'
        t.problem("min_gpu_memory", why)
        return 0
    if cpu and size:
        t.problem("min_gpu_memory", 'must be unset when gpu_class is "cpu"')
    return size


def _size_bytes(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str) or not (match := _SIZE.fullmatch(value.strip())):
        return None
    if len(match[1]) > 20:
        return None
    size = Fraction(match[1]) * _UNITS[match[2].lower()]
    return int(size) if size.denominator == 1 else None  # else not a whole number of bytes


# -- writing -------------------------------------------------------------------------------


def render_document(document: Document) -> str:
    """``document`` as TOML that :func:`parse_document` reads back to an equal document.

    Every resolved field is written (tp, pp, nodes, gpus_per_node and served_model_name
    even where they were defaults), except empty ones and, for ``cpu`` profiles, the
    parallel sizes.
    """
    blocks = [_render_profile(p) for p in document.profiles.values()]
    blocks += [render_deployment(d) for d in document.deployments.values()]
    return "\n".join(blocks)


def _render_profile(p: EngineProfile) -> str:
    fields: list[tuple[str, object]] = [("engine", p.engine), ("gpu_class", p.gpu_class)]
    if p.gpu_class != CPU_CLASS:
        fields += [("tp", p.tp), ("pp", p.pp), ("nodes", p.nodes)]
        fields += [("gpus_per_node", p.gpus_per_node)]
    fields += [("model_path", p.model_path), ("served_model_name", p.served_model_name)]
    fields += [("kv_events", p.kv_events)]
    optional: list[tuple[str, object]] = [
        ("args", list(p.args)),
        ("env", dict(p.env)),
        ("adapters", [{"name": a.name, "path": a.path} for a in p.adapters]),
        ("cpu_threads", p.cpu_threads),
        ("min_gpu_memory", _format_size(p.min_gpu_memory_bytes)),
    ]
    fields += [(key, value) for key, value in optional if value]
    return render_table(("profiles", p.name), fields)


def _format_size(size: int) -> str | int:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return size
