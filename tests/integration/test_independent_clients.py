"""Clients we did not write talk to the real server: grpcio, and ``buf curl`` (Go).

Our own client and server share one protobuf implementation (betterproto2), so a mistake in
the wire format could cancel out between them. Here the replies are decoded by Google's
protobuf runtime (stubs generated with ``grpc_tools.protoc`` inside the test) and by
``buf curl``, over native gRPC and gRPC-web, unary and streaming.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.resources
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import betterproto2
import grpc
import pytest
from grpc_tools import protoc
from procs import Cluster, wait_for

from llmgw.client import ControlClient, GrpcWebChannel
from llmgw.protocol import PROTOCOL_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
BUF_AT = ROOT / ".ci" / "node" / "node_modules" / ".bin" / "buf"
GENERATED_PACKAGE = "indep_llmgw"  # not "llmgw": that name is our own package
SERVICE = "llmgw.v1.ControlService"


# --- grpcio stubs, generated here --------------------------------------------------------


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """grpcio stubs for protos/, as modules of the package ``indep_llmgw``.

    protoc names Python modules after proto file paths, and ``llmgw.v1`` is taken by our
    own package, so the protos are copied under ``indep_llmgw/v1`` with their import lines
    rewritten to match. Package, message and service names (all that goes on the wire)
    are untouched.
    """
    root = tmp_path_factory.mktemp("grpcio")
    src, out = root / "src", root / "out"
    (src / GENERATED_PACKAGE / "v1").mkdir(parents=True)
    out.mkdir()
    names = sorted(p.name for p in (PROTOS / "llmgw" / "v1").glob("*.proto"))
    assert {"control.proto", "inventory.proto", "workload.proto"} <= set(names)
    for name in names:
        text = (PROTOS / "llmgw" / "v1" / name).read_text()
        text = text.replace('import "llmgw/v1/', f'import "{GENERATED_PACKAGE}/v1/')
        (src / GENERATED_PACKAGE / "v1" / name).write_text(text)
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{src}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        *(f"{GENERATED_PACKAGE}/v1/{name}" for name in names),
    ]
    assert protoc.main(args) == 0, f"protoc failed: {args}"
    sys.path.insert(0, str(out))
    try:
        control = importlib.import_module(f"{GENERATED_PACKAGE}.v1.control_pb2")
        control_grpc = importlib.import_module(f"{GENERATED_PACKAGE}.v1.control_pb2_grpc")
        history = importlib.import_module(f"{GENERATED_PACKAGE}.v1.history_pb2")
    finally:
        sys.path.remove(str(out))
    return SimpleNamespace(control=control, grpc=control_grpc, history=history)


def _grpcio_nodes(stub: Any, pb: SimpleNamespace) -> dict[str, Any]:
    reply = stub.GetCluster(pb.control.GetClusterRequest(), timeout=5)
    return {node.info.node_id: node for node in reply.nodes}


def test_grpcio_client_reads_the_cluster_and_the_statuses(
    cluster: Cluster, pb: SimpleNamespace
) -> None:
    cluster.start_server()
    cluster.start_agent("a1", "dgx-h100")
    with grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}") as channel:
        stub = pb.grpc.ControlServiceStub(channel)
        ready = pb.control.NODE_STATE_READY
        wait_for(
            lambda: getattr(_grpcio_nodes(stub, pb).get("a1"), "state", None) == ready,
            30,
            "a1 READY, seen by grpcio",
        )

        node = _grpcio_nodes(stub, pb)["a1"]
        assert node.connected
        assert node.protocol_version == PROTOCOL_VERSION
        assert node.registered_unix_ms > 0 and node.last_heartbeat_unix_ms > 0
        gpus = node.info.gpus
        assert len(gpus) == 8
        assert sorted(g.index for g in gpus) == list(range(8))
        assert len({g.uuid for g in gpus}) == 8 and all(g.uuid.startswith("GPU-") for g in gpus)
        assert {g.gpu_class for g in gpus} == {"H100"}
        assert all(g.memory_total_bytes >= 80 * 10**9 for g in gpus)
        assert all(sorted(g.nvlink_peers) == [i for i in range(8) if i != g.index] for g in gpus)

        # a server stream, decoded by grpcio: the first event is a snapshot holding a1
        watch = stub.Watch(pb.control.WatchRequest(), timeout=10)
        try:
            first = next(watch)
        finally:
            watch.cancel()
        assert first.WhichOneof("event") == "snapshot"
        assert [n.info.node_id for n in first.snapshot.nodes] == ["a1"]
        assert len(first.snapshot.nodes[0].info.gpus) == 8

        assert list(stub.ListProfiles(pb.control.ListProfilesRequest(), timeout=5).profiles) == []
        stats = stub.GetRouterStats(pb.control.GetRouterStatsRequest(), timeout=5)
        assert stats.at_unix_ms > 0 and stats.decisions == 0  # the in-server gateway's

        with pytest.raises(grpc.RpcError) as missing:
            stub.CordonNode(pb.control.NodeRequest(node_id="nope"), timeout=5)
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND
        assert "'nope'" in missing.value.details()

        result = stub.CordonNode(pb.control.NodeRequest(node_id="a1"), timeout=5)
        assert result.ok and result.message == "node a1 cordoned"
        assert _grpcio_nodes(stub, pb)["a1"].state == pb.control.NODE_STATE_CORDONED

        described = stub.Describe(pb.history.DescribeRequest(kind="node", name="a1"), timeout=5)
        assert described.node.cordoned and described.node.info.node_id == "a1"
        assert {"Registered", "cordon"} <= {e.reason for e in described.events}


# --- buf curl ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def buf() -> str:
    """The ``buf`` executable: on PATH or where .ci/run installs it.

    Missing: skipped on a developer's machine, a failure in CI (CI=true).
    """
    found = shutil.which("buf")
    if found is None and BUF_AT.is_file() and os.access(BUF_AT, os.X_OK):
        found = str(BUF_AT)
    if found is not None:
        return found
    why = f"buf is neither on PATH nor at {BUF_AT} (bash .ci/run installs it with npm)"
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _buf_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "BUF_CACHE_DIR": str(tmp_path / "buf-cache")}


def _buf_curl(
    buf: str, tmp_path: Path, url: str, *flags: str, data: str | None = None
) -> subprocess.CompletedProcess[str]:
    args = [buf, "curl", "--schema", str(PROTOS), *flags, url]
    if data is not None:
        args[2:2] = ["--data", data]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=30, env=_buf_env(tmp_path), check=False
    )


def _assert_lists_a1(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert [n["info"]["nodeId"] for n in reply["nodes"]] == ["a1"]
    node = reply["nodes"][0]
    assert node["state"] == "NODE_STATE_READY"
    gpus = node["info"]["gpus"]
    assert len(gpus) == 8
    assert len({g["uuid"] for g in gpus}) == 8
    assert {g["gpuClass"] for g in gpus} == {"H100"}


def test_buf_curl_unary_over_grpc_web_and_native_grpc(
    cluster: Cluster, buf: str, tmp_path: Path
) -> None:
    cluster.start_server()
    cluster.start_agent("a1", "dgx-h100")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")

    web = _buf_curl(buf, tmp_path, f"{cluster.url}/{SERVICE}/GetCluster", "--protocol", "grpcweb")
    _assert_lists_a1(web)
    native = _buf_curl(
        buf,
        tmp_path,
        f"http://127.0.0.1:{cluster.grpc_port}/{SERVICE}/GetCluster",
        "--protocol",
        "grpc",
        "--http2-prior-knowledge",
    )
    _assert_lists_a1(native)

    missing = _buf_curl(
        buf,
        tmp_path,
        f"{cluster.url}/{SERVICE}/CordonNode",
        "--protocol",
        "grpcweb",
        data='{"nodeId": "nope"}',
    )
    # buf curl exits with the gRPC code shifted left by three bits (NOT_FOUND is 5)
    assert missing.returncode == 5 << 3, (missing.stdout, missing.stderr)
    error = json.loads(missing.stderr[missing.stderr.index("{") :])
    assert error["code"] == "not_found"
    assert "'nope'" in error["message"]

    cordoned = _buf_curl(
        buf,
        tmp_path,
        f"{cluster.url}/{SERVICE}/CordonNode",
        "--protocol",
        "grpcweb",
        data='{"nodeId": "a1"}',
    )
    assert cordoned.returncode == 0, cordoned.stderr
    assert json.loads(cordoned.stdout) == {"ok": True, "message": "node a1 cordoned"}


# --- Watch: a stream that stays open ----------------------------------------------------


def _is_node_event(event: Any, node_id: str) -> bool:
    name, value = betterproto2.which_one_of(event, "event")
    return name == "node" and value.info.node_id == node_id  # type: ignore[union-attr]


async def test_watch_over_grpc_web_with_our_client(cluster: Cluster) -> None:
    await asyncio.to_thread(cluster.start_server)
    await asyncio.to_thread(cluster.start_agent, "a1")
    await asyncio.to_thread(
        wait_for, lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY"
    )
    async with GrpcWebChannel(cluster.url) as channel:
        events = ControlClient(channel).watch()
        try:
            async with asyncio.timeout(10):
                first = await anext(events)
            name, snapshot = betterproto2.which_one_of(first, "event")
            assert name == "snapshot"
            assert [n.info.node_id for n in snapshot.nodes] == ["a1"]  # type: ignore[union-attr]
            assert len(snapshot.nodes[0].info.gpus) == 8  # type: ignore[union-attr]

            await asyncio.to_thread(cluster.start_agent, "a2")
            revisions = [first.revision]
            joined = None
            async with asyncio.timeout(15):
                async for event in events:
                    revisions.append(event.revision)
                    if _is_node_event(event, "a2"):
                        joined = event.node
                        break
            assert joined is not None, "the Watch ended before a2 joined"
            assert len(joined.info.gpus) == 8  # type: ignore[union-attr]
            assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
        finally:
            await events.aclose()  # type: ignore[attr-defined]


def _read_json_objects(stream: IO[str], out: queue.Queue[dict[str, Any] | None]) -> None:
    """buf prints each message as indented JSON ending with a ``}`` line of its own."""
    text = ""
    for line in stream:
        text += line
        if line.rstrip("\n") == "}":
            out.put(json.loads(text))
            text = ""
    out.put(None)


@contextlib.contextmanager
def _buf_watch(buf: str, cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Run ``buf curl`` on Watch; yield ``until(predicate, timeout, what)``."""
    stderr = (tmp_path / "buf-watch.err").open("w")
    proc = subprocess.Popen(
        [
            buf,
            "curl",
            "--schema",
            str(PROTOS),
            "--protocol",
            "grpcweb",
            f"{cluster.url}/{SERVICE}/Watch",
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        text=True,
        env=_buf_env(tmp_path),
        start_new_session=True,  # npm's buf is a node wrapper around the Go binary: kill both
    )
    assert proc.stdout is not None
    objects: queue.Queue[dict[str, Any] | None] = queue.Queue()
    reader = threading.Thread(target=_read_json_objects, args=(proc.stdout, objects), daemon=True)
    reader.start()

    def until(check: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> Any:
        seen = 0
        while True:
            try:
                event = objects.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout}s ({seen} events)") from None
            if event is None:
                err = (tmp_path / "buf-watch.err").read_text()
                raise AssertionError(f"buf's stream ended before {what}: {err}")
            seen += 1
            if check(event):
                return event

    try:
        yield until
        assert proc.poll() is None, "buf curl ended a Watch that never ends"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        reader.join(timeout=10)
        proc.stdout.close()
        stderr.close()


def test_watch_over_grpc_web_with_buf_curl(cluster: Cluster, buf: str, tmp_path: Path) -> None:
    cluster.start_server()
    cluster.start_agent("a1")
    wait_for(lambda: cluster.node_states() == {"a1": "NODE_STATE_READY"}, 30, "a1 READY")
    with _buf_watch(buf, cluster, tmp_path) as until:
        first = until(lambda e: True, 15, "the first event")
        assert "snapshot" in first, f"the first event is not a snapshot: {sorted(first)}"
        assert [n["info"]["nodeId"] for n in first["snapshot"]["nodes"]] == ["a1"]

        cluster.start_agent("a2", "l4-pcie")
        joined = until(
            lambda e: e.get("node", {}).get("info", {}).get("nodeId") == "a2",
            15,
            "a node event for a2",
        )
        assert len(joined["node"]["info"]["gpus"]) == 4
        assert {g["gpuClass"] for g in joined["node"]["info"]["gpus"]} == {"L4"}
        assert int(joined["revision"]) > int(first["revision"])
        # and the stream keeps going: a2's heartbeats follow as telemetry deltas
        until(lambda e: e.get("nodeTelemetry", {}).get("nodeId") == "a2", 15, "telemetry from a2")
