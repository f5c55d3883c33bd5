"""Bad bytes against the real server process, on both ports: refused with the right status,
and the server keeps serving (GetCluster still answers, a registered agent stays READY).

The requests are raw bytes sent by grpcio (native port) and httpx (gRPC-web port), so no
encoder of ours stands between the test and the wire.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable, Iterator

import grpc
import httpx
import pytest
from grpclib.metadata import decode_grpc_message
from procs import Cluster, wait_for

from llmgw.api.llmgw.v1 import (
    AgentMessage,
    ControlMessage,
    NodeInfo,
    NodeState,
    Register,
)
from llmgw.api.llmgw.v1 import Cluster as ClusterView
from llmgw.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LIMIT = 4 * 1024 * 1024  # the server's default --max-message-bytes
CONTROL = "/llmgw.v1.ControlService/"
CONNECT = "/llmgw.v1.AgentService/Connect"
GARBAGE = b"\xde\xad\xbe\xef" * 4  # a tag varint that never ends
GRPC_WEB = {"content-type": "application/grpc-web+proto", "x-grpc-web": "1"}


@pytest.fixture
def serving(cluster: Cluster) -> Iterator[Cluster]:
    """A server with one simulated agent, a1, READY."""
    cluster.start_server()
    cluster.start_agent("a1")
    wait_for(lambda: _state(cluster, "a1") is NodeState.READY, 30, "a1 READY")
    yield cluster


# --- helpers -----------------------------------------------------------------------------


def _channel(cluster: Cluster) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")


def _unary(cluster: Cluster, method: str, request: bytes) -> bytes:
    """One unary call on the native port with ``request`` as the raw message bytes."""
    with _channel(cluster) as channel:
        call = channel.unary_unary(CONTROL + method)  # no serializers: bytes in, bytes out
        return bytes(call(request, timeout=10))


def _refused(cluster: Cluster, method: str, request: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        _unary(cluster, method, request)
    return refused.value


def _get_cluster(cluster: Cluster) -> ClusterView:
    return ClusterView.parse(_unary(cluster, "GetCluster", b""))


def _state(cluster: Cluster, node_id: str) -> NodeState | None:
    try:
        nodes = {n.info.node_id: n for n in _get_cluster(cluster).nodes}  # type: ignore[union-attr]
    except grpc.RpcError:
        return None
    node = nodes.get(node_id)
    return None if node is None else node.state


def _assert_still_serving(cluster: Cluster, since_ms: int) -> None:
    """The server process runs, answers GetCluster, and a1 keeps heartbeating, READY."""
    assert cluster.procs["server"].poll() is None, "the server process died"

    def a1_fresh() -> bool:
        a1 = next(n for n in _get_cluster(cluster).nodes if n.info.node_id == "a1")  # type: ignore[union-attr]
        return a1.state is NodeState.READY and a1.last_heartbeat_unix_ms > since_ms

    wait_for(a1_fresh, 10, "a heartbeat of a1 after the bad input, a1 still READY")
    assert "Traceback" not in cluster.log("server")


def _now_ms() -> int:
    return int(time.time() * 1000)


def _register(node_id: str, version: int = PROTOCOL_VERSION) -> bytes:
    node = NodeInfo(node_id=node_id)
    return bytes(AgentMessage(register=Register(protocol_version=version, node=node)))


class _Requests:
    """A request stream for grpcio that the test feeds one raw message at a time."""

    def __init__(self) -> None:
        self._queue: queue.Queue[bytes | None] = queue.Queue()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._queue.get, None)

    def send(self, message: bytes) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)


def _grpc_web(
    cluster: Cluster, method: str, body: bytes | Iterable[bytes]
) -> tuple[int, dict[str, str]]:
    """POST a gRPC-web body; the HTTP status and the fields of the trailer frame."""
    response = httpx.post(
        f"{cluster.url}{CONTROL}{method}", content=body, headers=GRPC_WEB, timeout=20
    )
    content = response.content
    trailer: dict[str, str] = {}
    while content:
        flag, length = content[0], int.from_bytes(content[1:5], "big")
        payload, content = content[5 : 5 + length], content[5 + length :]
        if flag == 0x80:
            for line in payload.decode("ascii").split("\r\n"):
                if line:
                    key, _, value = line.partition(":")
                    trailer[key.lower()] = value.strip()
    return response.status_code, trailer


def _frame(payload: bytes) -> bytes:
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


# --- native port -------------------------------------------------------------------------


def test_garbage_request_is_invalid_argument_naming_the_message(serving: Cluster) -> None:
    since = _now_ms()
    error = _refused(serving, "GetCluster", GARBAGE)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode llmgw.v1.GetClusterRequest" in error.details()
    _assert_still_serving(serving, since)


def test_wrong_wire_type_is_invalid_argument(serving: Cluster) -> None:
    since = _now_ms()
    # NodeRequest.node_id is field 1, a string; here it arrives as the varint 1
    error = _refused(serving, "CordonNode", b"\x08\x01")
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "llmgw.v1.NodeRequest" in error.details()
    assert "node_id" in error.details() and "varint" in error.details()
    _assert_still_serving(serving, since)
    assert _state(serving, "a1") is NodeState.READY  # not cordoned by a misread request


def _unknown_field_message(size: int) -> bytes:
    """``size`` bytes that decode as any message: field 15, unknown, length-delimited."""
    payload = b"z" * (size - 1 - 4)  # a 4-byte length varint for sizes around 4 MiB
    message = b"\x7a" + _varint(len(payload)) + payload
    assert len(message) == size
    return message


def test_oversized_message_is_resource_exhausted(serving: Cluster) -> None:
    since = _now_ms()
    error = _refused(serving, "GetCluster", _unknown_field_message(LIMIT + 1))
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"message of {LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes" in error.details()
    _assert_still_serving(serving, since)
    # exactly at the limit is read, decoded (the unknown field skipped) and answered
    reply = ClusterView.parse(_unary(serving, "GetCluster", _unknown_field_message(LIMIT)))
    assert "a1" in {n.info.node_id for n in reply.nodes}  # type: ignore[union-attr]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# A client's value is echoed back cut short (llmgw.server.errors.quoted): a whole 64 KiB id
# would make a trailer grpcio refuses, and HPACK's Huffman coder is quadratic in its length.
LONG_ID = "n" * (64 * 1024)


def test_long_unknown_node_id_is_not_found_with_a_short_message(serving: Cluster) -> None:
    since = _now_ms()
    request = b"\x0a" + _varint(len(LONG_ID)) + LONG_ID.encode()
    error = _refused(serving, "CordonNode", request)
    assert error.code() is grpc.StatusCode.NOT_FOUND, error.details()[:200]
    assert len(error.details()) <= 1024
    _assert_still_serving(serving, since)


def test_register_with_a_long_bad_node_id_is_refused_with_a_short_message(
    serving: Cluster,
) -> None:
    since = _now_ms()
    requests = _Requests()
    with _channel(serving) as channel:
        replies = channel.stream_stream(CONNECT)(iter(requests), timeout=10)
        try:
            requests.send(_register("-" + LONG_ID))
            with pytest.raises(grpc.RpcError) as refused:
                next(replies)
        finally:
            requests.close()
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()[:200]
    assert len(refused.value.details()) <= 1024
    _assert_still_serving(serving, since)


def test_unsupported_protocol_version_is_refused_and_not_stored(serving: Cluster) -> None:
    since = _now_ms()
    requests = _Requests()
    with _channel(serving) as channel:
        replies = channel.stream_stream(CONNECT)(iter(requests), timeout=10)
        try:
            requests.send(_register("v99", version=99))
            with pytest.raises(grpc.RpcError) as refused:
                next(replies)
        finally:
            requests.close()
    error = refused.value
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "protocol version 99" in error.details()
    assert f"{MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}" in error.details()
    assert "v99" not in {n.info.node_id for n in _get_cluster(serving).nodes}  # type: ignore[union-attr]
    _assert_still_serving(serving, since)


def test_garbage_inside_an_agent_stream_ends_only_that_stream(serving: Cluster) -> None:
    since = _now_ms()
    requests = _Requests()
    with _channel(serving) as channel:
        replies = channel.stream_stream(CONNECT)(iter(requests), timeout=20)
        try:
            requests.send(_register("raw1"))
            registered = ControlMessage.parse(next(replies)).registered
            assert registered is not None
            assert registered.protocol_version == PROTOCOL_VERSION
            assert _state(serving, "raw1") is NodeState.READY

            # AgentMessage.heartbeat (field 2) whose seq varint is cut short
            requests.send(b"\x12\x02\x08\xff")
            with pytest.raises(grpc.RpcError) as ended:
                next(replies)
        finally:
            requests.close()
    error = ended.value
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode llmgw.v1.AgentMessage" in error.details()
    assert "heartbeat" in error.details()
    wait_for(lambda: _state(serving, "raw1") is NodeState.NOT_READY, 5, "raw1 NOT_READY")
    raw1 = next(n for n in _get_cluster(serving).nodes if n.info.node_id == "raw1")  # type: ignore[union-attr]
    assert not raw1.connected
    assert "llmgw.v1.AgentMessage" in raw1.state_reason
    _assert_still_serving(serving, since)


# --- gRPC-web port -----------------------------------------------------------------------


def test_grpc_web_garbage_is_invalid_argument(serving: Cluster) -> None:
    since = _now_ms()
    status, trailer = _grpc_web(serving, "GetCluster", _frame(GARBAGE))
    assert status == 200
    assert trailer["grpc-status"] == "3"
    assert "llmgw.v1.GetClusterRequest" in decode_grpc_message(trailer["grpc-message"])
    _assert_still_serving(serving, since)


def _chunks(body: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


@pytest.mark.parametrize("sent", ["with a content-length", "chunked"])
def test_grpc_web_oversized_frame_is_resource_exhausted(serving: Cluster, sent: str) -> None:
    since = _now_ms()
    body = _frame(b"x" * (LIMIT + 1))
    status, trailer = _grpc_web(
        serving, "GetCluster", body if sent == "with a content-length" else _chunks(body)
    )
    assert status == 200
    assert trailer["grpc-status"] == "8"
    assert f"limit of {LIMIT} bytes" in decode_grpc_message(trailer["grpc-message"])
    _assert_still_serving(serving, since)
    # the same port still answers a well-formed call
    status, trailer = _grpc_web(serving, "GetCluster", _frame(b""))
    assert (status, trailer["grpc-status"]) == (200, "0")
