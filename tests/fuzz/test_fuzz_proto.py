"""Fuzzing the server's protobuf door (``llmgw.server.wire.codec.decode_message``) for every
request type of ControlService, AgentService and RouterService, then the native gRPC port
end to end with the real services, and the agent stream's handler with well-formed but
arbitrary AgentMessages.

What must hold for any bytes: a message comes back, or ``GRPCError`` INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED past the size or field budget) whose text names the message type; a
message that comes back encodes again to bytes that decode to the same message; the server
answers with such a status (never INTERNAL or UNKNOWN) and keeps serving.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.server
import pytest
from fuzzkit import (
    async_growth,
    examples,
    growth,
    length_delimited,
    mutated,
    tag,
    varint,
    wire_message,
)
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError
from hypothesis import example, given
from hypothesis import strategies as st

from llmgw.agent.discovery import simulated_node
from llmgw.api.llmgw.v1 import (
    AgentMessage,
    AgentServiceBase,
    Cluster,
    ControlServiceBase,
    GetClusterRequest,
    Gpu,
    NodeInfo,
    Register,
    RouterServiceBase,
)
from llmgw.protocol import PROTOCOL_VERSION
from llmgw.server.state.inventory import InventoryConfig
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.agentsvc import AgentService
from llmgw.server.wire.codec import (
    DEFAULT_MAX_FIELDS,
    CheckedProtoCodec,
    decode_message,
    install_message_limit,
    proto_name,
)
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.routersvc import RouterService

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

HANDLERS = {
    path: handler
    for service in (ControlServiceBase(), AgentServiceBase(), RouterServiceBase())
    for path, handler in service.__mapping__().items()
}
REQUEST_TYPES = sorted({h.request_type for h in HANDLERS.values()}, key=lambda t: t.__name__)
UNARY = sorted(p for p, h in HANDLERS.items() if h.cardinality is Cardinality.UNARY_UNARY)
STREAMING = sorted(p for p, h in HANDLERS.items() if h.cardinality is not Cardinality.UNARY_UNARY)
REFUSALS = {Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED}

_typed_wire = st.sampled_from(REQUEST_TYPES).flatmap(
    lambda t: st.tuples(st.just(t), wire_message(t))
)


def decodes_or_is_refused(data: bytes, message_type: type[Any]) -> Any | None:
    """The decoded message, or None after checking the refusal is the documented one."""
    try:
        message = decode_message(data, message_type)
    except GRPCError as exc:
        assert exc.status in REFUSALS, exc
        assert exc.message is not None
        assert exc.message.startswith(f"cannot decode {proto_name(message_type)}: "), exc.message
        assert len(exc.message) < 1024  # it goes back in a trailer
        return None
    again = bytes(message)
    assert bytes(decode_message(again, message_type)) == again  # nothing odd was stored
    return message


# --- decode_message ----------------------------------------------------------------------


def test_every_request_type_is_covered() -> None:
    """The suite walks the services' own mappings: a new RPC is fuzzed without a change."""
    assert {t.__name__ for t in REQUEST_TYPES} >= {
        "AgentMessage", "ApplyDeploymentRequest", "NodeRequest", "RouterFeedRequest",
        "ReprofileReplicaRequest", "WatchRequest",
    }  # fmt: skip
    assert len(HANDLERS) == 25  # with issue #18's CreateKey, ListKeys, RevokeKey, GetUsage


@examples(300)
@given(_typed_wire)
def test_every_well_formed_encoding_decodes(typed: tuple[type[Any], bytes]) -> None:
    """A checker that refused too much would pass every other property here."""
    message_type, data = typed
    message = decode_message(data, message_type)
    assert bytes(message) == bytes(message_type.parse(data))
    assert bytes(decode_message(bytes(message), message_type)) == bytes(message)


@examples(400)
@given(st.sampled_from(REQUEST_TYPES), st.binary(max_size=300))
@example(AgentMessage, b"\x0a\x05\x12\x03\x4a\x01")  # a truncated Gpu inside Register.node
@example(AgentMessage, b"\x0a\x02\x12\x80")  # a length-delimited length cut short
def test_any_bytes_decode_or_are_refused_naming_the_type(
    message_type: type[Any], data: bytes
) -> None:
    decodes_or_is_refused(data, message_type)


@examples(400)
@given(_typed_wire.flatmap(lambda tw: st.tuples(st.just(tw[0]), mutated(st.just(tw[1])))))
def test_mutated_encodings_decode_or_are_refused(typed: tuple[type[Any], bytes]) -> None:
    decodes_or_is_refused(typed[1], typed[0])


def test_a_malformed_request_changes_no_shared_state() -> None:
    """The decoder keeps nothing between calls: 1,000 refused requests leave no trace."""
    rng = random.Random(8)
    garbage = [rng.randbytes(rng.randrange(1, 64)) for _ in range(2000)]
    garbage = [g for g in garbage if decodes_or_is_refused(g, AgentMessage) is None][:1000]
    assert len(garbage) == 1000

    def refuse_all() -> None:
        for data in garbage:
            with pytest.raises(GRPCError):
                decode_message(data, AgentMessage)

    assert growth(refuse_all) < 16 * 1024


# --- the field budget (found by this suite: amplification) -------------------------------


def _register(node: bytes) -> bytes:
    return length_delimited(1, length_delimited(2, node))  # AgentMessage.register.node


@pytest.mark.parametrize(
    ("data", "message_type"),
    [
        (_register(b"\x4a\x00" * 2_000_000), AgentMessage),  # two million empty Gpu
        (b"\x32\x00" * 2_000_000, NodeInfo),  # two million empty features strings
        (b"\xf8\x07\x01" * 1_000_000, NodeInfo),  # a million unknown varints
        (length_delimited(13, b"\x01" * 4_000_000), Gpu),  # four million packed nvlink peers
    ],
    ids=["empty-messages", "empty-strings", "unknown-fields", "packed-varints"],
)
def test_regression_a_message_of_millions_of_tiny_fields_is_refused_at_once(
    data: bytes, message_type: type[Any]
) -> None:
    """Found by this suite: 4 MiB of two-byte fields (legal under the size limit) made
    betterproto2 build two million objects: ~20 s of the event loop and ~1 GB."""
    started = time.perf_counter()
    with pytest.raises(GRPCError) as caught:
        decode_message(data, message_type)
    assert time.perf_counter() - started < 2.0
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == (
        f"cannot decode {proto_name(message_type)}: more than {DEFAULT_MAX_FIELDS} fields "
        "(nested and packed ones included)"
    )


def test_the_budget_counts_packed_elements_and_nested_fields_exactly() -> None:
    peers = length_delimited(13, b"\x01" * 99)  # Gpu.nvlink_peers: 1 field + 99 elements
    assert len(decode_message(peers, Gpu, max_fields=100).nvlink_peers) == 99
    with pytest.raises(GRPCError, match="more than 99 fields"):
        decode_message(peers, Gpu, max_fields=99)
    nested = _register(b"\x4a\x00" * 3)  # register, node, three gpus
    assert len(decode_message(nested, AgentMessage, max_fields=5).register.node.gpus) == 3  # type: ignore[union-attr]
    with pytest.raises(GRPCError, match="more than 4 fields"):
        decode_message(nested, AgentMessage, max_fields=4)


@pytest.mark.parametrize("fixture", ["dgx-h100", "a100-mig", "gb200-nvl4"])
def test_real_registrations_are_far_under_the_field_budget(fixture: str) -> None:
    node = simulated_node(fixture, node_id="n1", hostname="n1")
    data = bytes(AgentMessage(register=Register(node=node, protocol_version=PROTOCOL_VERSION)))
    decoded = decode_message(data, AgentMessage, max_fields=DEFAULT_MAX_FIELDS // 16)
    assert decoded.register.node == node  # type: ignore[union-attr]


def test_the_codec_passes_its_field_budget_on() -> None:
    codec = CheckedProtoCodec(max_fields=3)
    assert codec.decode(b"\x4a\x00" * 3, NodeInfo).gpus == [Gpu()] * 3  # type: ignore[attr-defined]
    with pytest.raises(GRPCError, match="more than 3 fields"):
        codec.decode(b"\x4a\x00" * 4, NodeInfo)
    with pytest.raises(ValueError, match="max_fields must be positive"):
        CheckedProtoCodec(max_fields=0)


# --- the native port, end to end ---------------------------------------------------------


class BytesCodec(CodecBase):
    """A client codec that sends and returns raw bytes, so the test can send anything."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


@dataclass
class Native:
    channel: Channel
    plane: ControlPlane


@pytest.fixture
async def native(tmp_path: Path) -> AsyncIterator[Native]:
    """The three real services on one grpclib server, as ``llmgw server`` runs them."""
    install_message_limit()
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store, InventoryConfig(grace_s=1.0))
        await plane.load()
        agents, router = AgentService(plane), RouterService(plane)
        server = grpclib.server.Server(
            [agents, ControlService(plane), router], codec=CheckedProtoCodec()
        )
        await server.start("127.0.0.1", 0)
        port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        channel = Channel("127.0.0.1", port, codec=BytesCodec())
        try:
            yield Native(channel, plane)
        finally:
            channel.close()
            agents.shutdown()
            router.shutdown()
            server.close()
            await server.wait_closed()


async def _call(channel: Channel, path: str, data: bytes) -> tuple[Status, str | None]:
    """Send ``data`` as the one request message of ``path``; the call's final status."""
    cardinality = HANDLERS[path].cardinality
    try:
        async with asyncio.timeout(10):
            async with channel.request(path, cardinality, bytes, bytes) as stream:
                await stream.send_message(data, end=True)
                while await stream.recv_message() is not None:
                    pass
                await stream.recv_trailing_metadata()
    except GRPCError as exc:
        return exc.status, exc.message
    return Status.OK, None


async def _still_serves(channel: Channel) -> None:
    status, _ = await _call(channel, "/llmgw.v1.ControlService/GetCluster", b"")
    assert status is Status.OK


def _wire_of(path: str) -> st.SearchStrategy[bytes]:
    return wire_message(HANDLERS[path].request_type)


_NEVER_DECODES = b"\x00"  # field number 0: a streaming call must not start for real


@examples(60, shared_fixture=True)
@given(
    st.sampled_from(UNARY + STREAMING),
    st.binary(max_size=200) | mutated(_typed_wire.map(lambda tw: tw[1])),
)
async def test_native_port_refuses_bad_bytes_on_every_rpc_and_keeps_serving(
    native: Native, path: str, data: bytes
) -> None:
    if path in STREAMING:
        data = _NEVER_DECODES + data
    status, message = await _call(native.channel, path, data)
    if path in STREAMING:
        assert status is Status.INVALID_ARGUMENT, (status, message)
    else:
        assert status not in (Status.INTERNAL, Status.UNKNOWN), (status, message)
    await _still_serves(native.channel)


@examples(60, shared_fixture=True)
@given(st.sampled_from(UNARY).flatmap(lambda p: st.tuples(st.just(p), _wire_of(p))))
async def test_native_port_answers_well_formed_nonsense_with_a_status_not_a_crash(
    native: Native, call: tuple[str, bytes]
) -> None:
    """Well-formed requests with arbitrary content reach the real operator handlers."""
    status, message = await _call(native.channel, *call)
    assert status not in (Status.INTERNAL, Status.UNKNOWN), (call, status, message)
    await _still_serves(native.channel)


async def test_regression_native_port_refuses_a_field_bomb_quickly(native: Native) -> None:
    """Under the default 4 MiB size limit: two million empty Gpu in one Register."""
    bomb = _register(b"\x4a\x00" * 2_000_000)
    started = time.perf_counter()
    status, message = await _call(native.channel, "/llmgw.v1.AgentService/Connect", bomb)
    assert status is Status.RESOURCE_EXHAUSTED, (status, message)
    assert message is not None and "more than 65536 fields" in message
    assert time.perf_counter() - started < 5.0
    await _still_serves(native.channel)


# --- the agent stream's handler ----------------------------------------------------------


class FakeAgentStream:
    """What ``AgentService._connect`` uses of a grpclib server stream; messages come
    through the real codec, so the handler sees exactly what the port would give it."""

    def __init__(self, wires: list[bytes]) -> None:
        codec = CheckedProtoCodec()
        self._messages = [codec.decode(w, AgentMessage) for w in wires]
        self.sent: list[Any] = []
        self.peer = None
        self.ended: Status | None = None

    async def recv_message(self) -> Any:
        return self._messages.pop(0) if self._messages else None

    def __aiter__(self) -> FakeAgentStream:
        return self

    async def __anext__(self) -> Any:
        if not self._messages:
            raise StopAsyncIteration
        return self._messages.pop(0)

    async def send_message(self, message: Any) -> None:
        self.sent.append(message)

    async def send_trailing_metadata(self, *, status: Status, **_: Any) -> None:
        self.ended = status  # a refusal with a retry hint (a registration over the rate)


_REGISTER = bytes(
    AgentMessage(
        register=Register(
            node=NodeInfo(node_id="n1", gpus=[Gpu(index=0, uuid="GPU-0")]),
            protocol_version=PROTOCOL_VERSION,
        )
    )
)
_AGENT_MESSAGES = st.lists(wire_message(AgentMessage), max_size=8)


@pytest.fixture
async def plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    async with Store(tmp_path / "s.db") as store:
        control_plane = ControlPlane(store, InventoryConfig(grace_s=1.0))
        await control_plane.load()
        yield control_plane


@examples(150, shared_fixture=True)
@given(st.booleans(), _AGENT_MESSAGES)
async def test_any_agent_stream_ends_with_a_status_and_the_plane_stays_encodable(
    plane: ControlPlane, registered: bool, wires: list[bytes]
) -> None:
    """Heartbeats, shard reports and KV deltas of any content after a Register (or in its
    place): the stream ends normally or with a client-fault status, and the cluster view
    every operator reads still encodes and decodes."""
    service = AgentService(plane)
    stream = FakeAgentStream([_REGISTER, *wires] if registered else wires)
    try:
        await service._connect(stream)  # type: ignore[arg-type]
    except GRPCError as exc:
        assert exc.status in (Status.INVALID_ARGUMENT, Status.FAILED_PRECONDITION), exc
    snapshot = bytes(plane.snapshot())
    assert bytes(decode_message(snapshot, Cluster, max_fields=1 << 30)) == snapshot
    assert "n1" not in service.connections


async def test_the_agent_stream_handler_keeps_no_memory_per_refused_stream(
    plane: ControlPlane,
) -> None:
    """1,000 streams whose first message is not a Register: nothing accumulates."""
    heartbeat = bytes(AgentMessage.parse(length_delimited(2, tag(1, 0) + varint(7))))
    service = AgentService(plane)

    async def refuse_all() -> None:
        for _ in range(1000):
            await asyncio.sleep(0)  # a loop turn, as between network reads: asyncio drops
            # the Register timeout's cancelled timer handles only when it runs
            stream = FakeAgentStream([heartbeat])
            try:
                await service._connect(stream)  # type: ignore[arg-type]
            except GRPCError as exc:
                assert exc.status is Status.INVALID_ARGUMENT, exc
            else:  # past the registration rate: refused before its first message is read
                assert stream.ended is Status.RESOURCE_EXHAUSTED

    assert await async_growth(refuse_all) < 32 * 1024
    assert (await ControlService(plane).get_cluster(GetClusterRequest())).nodes == []
