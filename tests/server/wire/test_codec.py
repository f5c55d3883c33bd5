"""Request decoding: bad bytes are refused with INVALID_ARGUMENT and the server keeps serving."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import betterproto2
import grpclib.server
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError

from llmgw.api.llmgw.v1 import (
    ActionResult,
    Cluster,
    ControlServiceBase,
    GetClusterRequest,
    NodeRequest,
    RouterStats,
)
from llmgw.server.wire.codec import CheckedProtoCodec, decode_message, install_message_limit

GET_CLUSTER = "/llmgw.v1.ControlService/GetCluster"
CORDON_NODE = "/llmgw.v1.ControlService/CordonNode"
LIMIT = 1000


def tag(number: int, wire_type: int) -> bytes:
    return betterproto2.encode_varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, 2) + betterproto2.encode_varint(len(payload)) + payload


@dataclass(eq=False, repr=False)
class Tree(betterproto2.Message):
    """A recursive message, to prove the nesting limit (no llmgw message recurses)."""

    child: Tree | None = betterproto2.field(1, betterproto2.TYPE_MESSAGE, optional=True)


# --- decode_message on bytes ---------------------------------------------------------------


def test_decodes_a_well_formed_message() -> None:
    cluster = Cluster(revision=7, router_stats=RouterStats(decisions_by_tier={"precise": 3}))
    assert decode_message(bytes(cluster), Cluster) == cluster


def test_keeps_unknown_fields_from_a_newer_peer() -> None:
    data = length_delimited(99, b"future") + tag(6, 0) + b"\x07"
    decoded = decode_message(data, Cluster)
    assert decoded.revision == 7
    assert bytes(decoded).endswith(length_delimited(99, b"future"))


@pytest.mark.parametrize(
    ("data", "message_type", "expected"),
    [
        (tag(6, 2) + b"\x02\x01\x02", Cluster, "revision (6) is uint64 but arrived as length"),
        (tag(5, 0) + b"\x05", Cluster, "field router_stats (5) is message but arrived as varint"),
        (tag(1, 0) + b"\x05", NodeRequest, "field node_id (1) is string but arrived as varint"),
        (tag(6, 5) + b"\x01\x02\x03\x04", Cluster, "revision (6) is uint64 but arrived as fixed32"),
        (
            length_delimited(5, length_delimited(2, length_delimited(2, b"x"))),
            Cluster,
            "field router_stats.decisions_by_tier.value (2) is uint64 but arrived as length",
        ),
        (length_delimited(1, tag(1, 0) + b"\x01"), Cluster, "field nodes.info (1) is message"),
    ],
    ids=["scalar-as-bytes", "message-as-varint", "string-as-varint", "uint64-as-fixed32",
         "nested-map-value", "nested-message"],
)  # fmt: skip
def test_refuses_wrong_wire_types_naming_the_field(
    data: bytes, message_type: type[Any], expected: str
) -> None:
    with pytest.raises(GRPCError) as caught:
        decode_message(data, message_type)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message is not None
    assert expected in caught.value.message


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff\xff\xff", "truncated varint"),
        (tag(1, 2) + b"\x10abc", "field 1 is truncated"),
        (tag(6, 0) + b"\xff" * 11, "varint longer than 10 bytes"),
        (tag(6, 3), "unsupported wire type 3"),
        (b"\x00\x01", "field number 0"),
        (length_delimited(1, length_delimited(1, length_delimited(1, b"\xff"))), "UTF-8"),
    ],
    ids=["garbage", "truncated-field", "long-varint", "group", "field-zero", "bad-utf8"],
)
def test_refuses_malformed_bytes_naming_the_type(data: bytes, expected: str) -> None:
    with pytest.raises(GRPCError) as caught:
        decode_message(data, Cluster)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message is not None
    assert caught.value.message.startswith("cannot decode llmgw.v1.Cluster: ")
    assert expected in caught.value.message


def test_refuses_messages_nested_too_deep() -> None:
    data = b""
    for _ in range(200):
        data = length_delimited(1, data)
    with pytest.raises(GRPCError, match="nested deeper than 64 levels"):
        decode_message(data, Tree)
    shallow = length_delimited(1, length_delimited(1, b""))
    assert decode_message(shallow, Tree).child is not None


def test_codec_refuses_a_nonpositive_limit() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        CheckedProtoCodec(max_message_bytes=0)


# --- the receive limit -------------------------------------------------------------------


class FakeH2Stream:
    """Just enough of grpclib.protocol.Stream for recv_message; records what was read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.read = 0

    async def recv_data(self, size: int) -> bytes:
        chunk = self.data[self.read : self.read + size]
        self.read += len(chunk)
        return chunk


async def test_oversized_message_is_refused_before_it_is_buffered() -> None:
    install_message_limit()
    install_message_limit()  # idempotent
    stream = FakeH2Stream(b"\x00" + (LIMIT + 1).to_bytes(4, "big") + b"x" * (LIMIT + 1))
    with pytest.raises(GRPCError) as caught:
        await grpclib.server.recv_message(stream, CheckedProtoCodec(LIMIT), Cluster)  # type: ignore[attr-defined, arg-type]
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == "message of 1001 bytes exceeds the limit of 1000 bytes"
    assert stream.read == 5


async def test_compressed_message_is_refused() -> None:
    install_message_limit()
    stream = FakeH2Stream(b"\x01\x00\x00\x00\x00")
    with pytest.raises(GRPCError, match="compressed messages are not supported") as caught:
        await grpclib.server.recv_message(stream, CheckedProtoCodec(LIMIT), Cluster)  # type: ignore[attr-defined, arg-type]
    assert caught.value.status is Status.UNIMPLEMENTED


# --- a real server -----------------------------------------------------------------------


class TinyControl(ControlServiceBase):
    async def get_cluster(self, message: GetClusterRequest) -> Cluster:
        return Cluster(revision=7)

    async def cordon_node(self, message: NodeRequest) -> ActionResult:
        return ActionResult(ok=True, message=message.node_id)


class BytesCodec(CodecBase):
    """A client codec that sends and returns raw bytes, so tests can send anything."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


@pytest.fixture
async def channel() -> AsyncIterator[Channel]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = grpclib.server.Server([TinyControl()], codec=CheckedProtoCodec(LIMIT))
    await server.start(sock=listener)
    client = Channel("127.0.0.1", port, codec=BytesCodec())
    try:
        yield client
    finally:
        client.close()
        server.close()
        await server.wait_closed()


async def call(channel: Channel, path: str, data: bytes) -> bytes:
    async with channel.request(path, Cardinality.UNARY_UNARY, bytes, bytes) as stream:
        await stream.send_message(data, end=True)
        reply = await stream.recv_message()
        await stream.recv_trailing_metadata()
    assert isinstance(reply, bytes)
    return reply


async def refused(channel: Channel, path: str, data: bytes) -> GRPCError:
    with pytest.raises(GRPCError) as caught:
        await call(channel, path, data)
    return caught.value


async def still_serves(channel: Channel) -> None:
    assert Cluster.parse(await call(channel, GET_CLUSTER, bytes(GetClusterRequest()))).revision == 7
    reply = await call(channel, CORDON_NODE, bytes(NodeRequest(node_id="gpu-1")))
    assert ActionResult.parse(reply) == ActionResult(ok=True, message="gpu-1")


async def test_server_refuses_garbage_and_keeps_serving(channel: Channel) -> None:
    error = await refused(channel, GET_CLUSTER, b"\xff\xff\xff")
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message is not None
    assert error.message.startswith("cannot decode llmgw.v1.GetClusterRequest: ")
    await still_serves(channel)


async def test_server_refuses_wrong_wire_types_and_keeps_serving(channel: Channel) -> None:
    error = await refused(channel, CORDON_NODE, tag(1, 0) + b"\x05")
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message == (
        "cannot decode llmgw.v1.NodeRequest: field node_id (1) is string but arrived as varint"
    )
    await still_serves(channel)


async def test_server_refuses_invalid_utf8_and_keeps_serving(channel: Channel) -> None:
    error = await refused(channel, CORDON_NODE, length_delimited(1, b"gpu-\xff"))
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message is not None
    assert "field node_id (1) is not valid UTF-8" in error.message
    await still_serves(channel)


@pytest.mark.parametrize("size", [LIMIT + 1, 5 * 1024 * 1024])
async def test_server_refuses_oversized_messages_and_keeps_serving(
    channel: Channel, size: int
) -> None:
    error = await refused(channel, CORDON_NODE, length_delimited(1, b"n" * size))
    assert error.status is Status.RESOURCE_EXHAUSTED
    assert error.message is not None
    assert error.message.endswith(f"exceeds the limit of {LIMIT} bytes")
    await still_serves(channel)


async def test_server_accepts_a_message_at_the_limit(channel: Channel) -> None:
    request = length_delimited(1, b"n" * (LIMIT - 3))
    assert len(request) == LIMIT
    assert ActionResult.parse(await call(channel, CORDON_NODE, request)).message == "n" * (
        LIMIT - 3
    )
