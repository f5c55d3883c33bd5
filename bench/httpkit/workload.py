"""The HTTP benchmark's workloads: pre-encoded requests and their checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from bench.httpkit.settings import GET_CLUSTER, Settings
from bench.kit import HOST, Connection, Reply

# ======================================================================================
# The workloads: pre-encoded requests and their checks (the client is bench.kit's)
# ======================================================================================


@dataclass(frozen=True, slots=True)
class Workload:
    key: str
    label: str
    raw: bytes
    check: Callable[[Reply], bool]
    conns: int
    nodes: int  # the cluster size of the server it runs against


def grpc_web_post(port: int, path: str, message: bytes) -> bytes:
    """A gRPC-web unary call, as grpc-web in a browser sends it, pre-encoded."""
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    head = (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {HOST}:{port}\r\n"
        "Content-Type: application/grpc-web+proto\r\n"
        "X-Grpc-Web: 1\r\n"
        "X-User-Agent: grpc-web-javascript/0.1\r\n"
        "Accept: application/grpc-web+proto\r\n"
        f"Content-Length: {len(body)}\r\n"
        "\r\n"
    )
    return head.encode("ascii") + body


def http_get(port: int, path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nAccept: */*\r\n\r\n".encode("ascii")


def grpc_ok(reply: Reply) -> bool:
    return reply.status == 200 and b"grpc-status:0\r\n" in reply.body[-64:]


def health_ok(reply: Reply) -> bool:
    return reply.status == 200 and reply.body == b"ok"


WORKLOADS: Final = ("cluster1", "clusterN", "emptyN", "healthN")


def workload_label(key: str, settings: Settings) -> str:
    n, nodes = settings.conns, settings.nodes
    return {
        "cluster1": f"GetCluster ({nodes} nodes), 1 conn",
        "clusterN": f"GetCluster ({nodes} nodes), {n} conns",
        "emptyN": f"GetCluster (0 nodes), {n} conns",
        "healthN": f"/healthz, {n} conns",
    }[key]


def workload(key: str, settings: Settings, port: int) -> Workload:
    """One of ``WORKLOADS``, against a server listening on ``port``."""
    label = workload_label(key, settings)
    get_cluster = grpc_web_post(port, GET_CLUSTER, b"")
    if key == "cluster1":
        return Workload(key, label, get_cluster, grpc_ok, 1, settings.nodes)
    if key == "clusterN":
        return Workload(key, label, get_cluster, grpc_ok, settings.conns, settings.nodes)
    if key == "emptyN":
        return Workload(key, label, get_cluster, grpc_ok, settings.conns, 0)
    return Workload(
        key, label, http_get(port, "/healthz"), health_ok, settings.conns, settings.nodes
    )


def split_frames(body: bytes) -> list[tuple[int, bytes]]:
    frames, at = [], 0
    while at + 5 <= len(body):
        length = int.from_bytes(body[at + 1 : at + 5], "big")
        frames.append((body[at], body[at + 5 : at + 5 + length]))
        at += 5 + length
    return frames


async def verify(port: int, nodes: int) -> int:
    """Check one GetCluster reply fully (a Cluster of ``nodes``); its body size in bytes."""
    from llmgw.api.llmgw.v1 import Cluster

    conn = await Connection.open(port)
    try:
        reply = await conn.request(grpc_web_post(port, GET_CLUSTER, b""))
        frames = split_frames(reply.body)
        if reply.status != 200 or len(frames) != 2 or frames[1][0] != 0x80:
            raise RuntimeError(f"unexpected GetCluster reply: {reply.status} {reply.body[:200]!r}")
        if b"grpc-status:0" not in frames[1][1]:
            raise RuntimeError(f"GetCluster failed: {frames[1][1]!r}")
        cluster = Cluster.parse(frames[0][1])
        if len(cluster.nodes) != nodes or any(
            n.info is None or not n.info.gpus for n in cluster.nodes
        ):
            raise RuntimeError(f"GetCluster returned {len(cluster.nodes)} nodes, not {nodes}")
        health = await conn.request(http_get(port, "/healthz"))
        if not health_ok(health):
            raise RuntimeError(f"/healthz answered {health.status} {health.body!r}")
        return len(reply.body)
    finally:
        conn.close()
