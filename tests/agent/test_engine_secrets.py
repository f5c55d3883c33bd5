"""The replica's API key reaches every engine through its environment, never its argv.

``/proc/PID/cmdline`` is readable by every user of a node; ``/proc/PID/environ`` only by the
engine's owner. These tests build the launch of every adapter and check where the key went,
that no repr shows it, and run SGLang's launcher (against a stand-in ``sglang`` package) to
see the key arrive in ``sys.argv`` inside the process while ``/proc/self/cmdline`` lacks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.engines import EngineBinaries, LaunchSpec, ShardSpec, build_launch
from llmgw.agent.engines.sglang import API_KEY_ENV as SGLANG_KEY_ENV
from llmgw.api.llmgw.v1 import EngineProfile, MultiNode

KEY = "sk-3f9c2a7e61d04b5c8e0f1a2b3c4d5e6f"
STATE = Path("/srv/llmgw/agent")
GPU = "GPU-5a3f0e2c-8d41-4b7e-9c1a-000000000000"


def spec(engine: str, api_key: str = KEY, **fields: Any) -> ShardSpec:
    model = "/models/q.gguf" if engine == "llamacpp" else "/models/chat"
    profile = EngineProfile(
        name="p", engine=engine, gpu_class="H100", tp=1, model_path=model, **fields
    )
    return ShardSpec("r1-s0", "r1", 0, profile, "fp", (GPU,), 8001, api_key)


def launch(shard: ShardSpec) -> LaunchSpec:
    return build_launch(shard, binaries=EngineBinaries(), state_dir=STATE)


# Where each engine reads its key from (vLLM envs.py, llama.cpp common/arg.cpp, our launcher).
KEY_VARIABLE = {
    "vllm": "VLLM_API_KEY",
    "sim": "VLLM_API_KEY",  # llmgw sim-engine reads it as vLLM does
    "llamacpp": "LLAMA_API_KEY",
    "sglang": SGLANG_KEY_ENV,
}


CASES = [*((engine, False) for engine in sorted(KEY_VARIABLE)), ("vllm", True), ("sim", True)]


@pytest.mark.parametrize(("engine", "kv_events"), CASES)
def test_the_key_is_in_the_environment_and_in_no_argument(engine: str, kv_events: bool) -> None:
    out = launch(spec(engine, kv_events=kv_events))
    assert not [word for word in out.argv if KEY in word]
    assert "--api-key" not in out.argv
    assert out.env[KEY_VARIABLE[engine]] == KEY
    assert out.secret_env == {KEY_VARIABLE[engine]}
    assert out.api_key == KEY  # what the agent's probes send


@pytest.mark.parametrize("engine", sorted(KEY_VARIABLE))
def test_without_a_key_no_variable_is_set(engine: str) -> None:
    out = launch(spec(engine, api_key=""))
    assert KEY_VARIABLE[engine] not in out.env
    if engine == "sglang":
        assert out.argv[1:3] == ("-m", "sglang.launch_server")  # no launcher needed


def test_a_headless_rank_gets_no_key() -> None:
    profile = EngineProfile(
        name="p", engine="vllm", gpu_class="H100", tp=2, gpus_per_node=1, nodes=2, model_path="/m"
    )
    where = MultiNode(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    out = launch(ShardSpec("r1-s1", "r1", 1, profile, "fp", (GPU,), 8001, KEY, where))
    assert not out.listens_http
    assert KEY not in json.dumps([out.argv, dict(out.env)])


@pytest.mark.parametrize("engine", sorted(KEY_VARIABLE))
def test_no_repr_shows_the_key(engine: str) -> None:
    shard = spec(engine)
    out = launch(shard)
    for text in (repr(shard), repr(out), str(out)):
        assert KEY not in text
    assert f"'{KEY_VARIABLE[engine]}': '***'" in repr(out)
    assert out.redacted_env()[KEY_VARIABLE[engine]] == "***"
    assert dict(out.env)[KEY_VARIABLE[engine]] == KEY  # the real environment keeps it


# --- SGLang's launcher, run for real against a stand-in sglang package -------------------

FAKE_LAUNCH_SERVER = """\
import json, logging, os, subprocess, sys
logging.basicConfig(level=logging.INFO)
logging.getLogger("sglang").info("server_args=ServerArgs(api_key=%r)", sys.argv[-1])
print("argv:", sys.argv[1:])
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get(%r, 'absent'))" % KEY_ENV],
    capture_output=True, text=True, check=True,
)
report = {
    "name": __name__,
    "argv": sys.argv[1:],
    "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
    "environ": os.environ.get(KEY_ENV),
    "child": child.stdout.strip(),
}
with open(os.environ["REPORT"], "w") as out:
    json.dump(report, out)
"""


def test_sglang_launcher_passes_the_key_inside_the_process_and_redacts_its_output(
    tmp_path: Path,
) -> None:
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = f"KEY_ENV = {SGLANG_KEY_ENV!r}\n" + FAKE_LAUNCH_SERVER
    (package / "launch_server.py").write_text(source)
    shard = spec("sglang", args=["--mem-fraction-static", "0.8"])
    out = build_launch(
        shard, binaries=EngineBinaries({"sglang": (sys.executable,)}), state_dir=tmp_path
    )
    report = tmp_path / "report.json"
    env = {**os.environ, **out.env, "PYTHONPATH": str(tmp_path), "REPORT": str(report)}
    done = subprocess.run(out.argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(report.read_text())
    assert seen["name"] == "__main__"
    assert seen["argv"][:2] == ["--model-path", "/models/chat"]
    assert seen["argv"][-4:] == ["--mem-fraction-static", "0.8", "--api-key", KEY]
    assert KEY not in seen["cmdline"] and "--model-path" in seen["cmdline"]
    assert seen["environ"] is None  # popped before SGLang runs
    assert seen["child"] == "absent"  # so SGLang's own processes never get it
    assert KEY not in done.stdout + done.stderr
    assert "server_args=ServerArgs(api_key='***')" in done.stderr
    assert "'--api-key', '***'" in done.stdout
