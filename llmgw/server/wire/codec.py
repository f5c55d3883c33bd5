"""Decoding requests so that no byte sequence can crash the server.

``decode_message`` is the one door through which request bytes become messages, on the
native gRPC port (``CheckedProtoCodec``) and on the gRPC-web port alike. Anything that is
not a well-formed encoding of the expected message is refused with ``INVALID_ARGUMENT``
naming the message type and what was wrong.

betterproto2 0.10.0 alone is not enough: its parser accepts a field sent with the wrong wire
type and stores whatever it read (a ``uint64`` sent length-delimited becomes a list, a
message field sent as a varint becomes an int, a string sent as a varint becomes an int);
it silently accepts truncated length-delimited fields and a truncated trailing tag, and it
answers other malformations with ``KeyError`` or ``EOFError``. So the bytes are first walked
against the message class's field metadata (``_check_message``), and only then parsed.

The walk also counts fields (nested ones and packed elements included) against
``max_fields``: betterproto2 builds each field on the one event loop, so a 4 MiB message of
two-byte fields (two million empty sub-messages) would hold the loop for many seconds and
take far more memory than its bytes. A DGX H100 registration holds ~1,400 fields; the
default allows 65,536, some forty times as many. More is refused with ``RESOURCE_EXHAUSTED``
before anything is parsed.

The monkeypatch
---------------
grpclib 0.4.9 has no limit on the size of a received message: ``grpclib.stream.recv_message``
reads the 5-byte prefix and then buffers whatever length it announces, so one client can
make the server hold gigabytes. ``install_message_limit`` replaces the name
``grpclib.server.recv_message`` (the server's own import of that function) with a version
that refuses a message longer than the codec's ``max_message_bytes`` before buffering any
of it. It is the only patch of a third-party library in llmgw; remove it when grpclib grows
a receive limit of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import betterproto2
import grpclib.server
from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from llmgw.api.message_pool import default_message_pool

if TYPE_CHECKING:
    from grpclib._typing import IProtoMessage
    from grpclib.encoding.base import CodecBase
    from grpclib.protocol import Stream

__all__ = [
    "DEFAULT_MAX_FIELDS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "CheckedProtoCodec",
    "decode_message",
    "field_bytes",
    "wire_of",
    "install_message_limit",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
DEFAULT_MAX_FIELDS: Final = 65_536
_MAX_DEPTH: Final = 64  # protobuf's own default recursion limit is 100
_MAX_VARINT_BYTES: Final = 10
_PATCHED_NAME: Final = "recv_message"  # grpclib.server's import of grpclib.stream.recv_message

_WIRE_NAMES: Final = {0: "varint", 1: "fixed64", 2: "length-delimited", 5: "fixed32"}
_VARINT_TYPES: Final = frozenset(betterproto2.WIRE_VARINT_TYPES)
_FIXED32_TYPES: Final = frozenset(betterproto2.WIRE_FIXED_32_TYPES)
_FIXED64_TYPES: Final = frozenset(betterproto2.WIRE_FIXED_64_TYPES)
_NESTED_TYPES: Final = frozenset({betterproto2.TYPE_MESSAGE, betterproto2.TYPE_MAP})
_CONTINUATION_BYTES: Final = bytes(range(0x80, 0x100))  # every byte of a varint but its last


class _Malformed(ValueError):
    """What is wrong with the bytes; becomes the text after ``cannot decode <Type>:``."""


class _TooManyFields(Exception):
    """The message holds more fields than its ``_Budget``."""


class _Budget:
    """The fields a message may still hold (see the module docstring)."""

    __slots__ = ("left",)

    def __init__(self, fields: int) -> None:
        self.left = fields

    def spend(self, count: int) -> None:
        self.left -= count
        if self.left < 0:
            raise _TooManyFields


def decode_message(
    data: bytes, message_type: type[T], *, max_fields: int = DEFAULT_MAX_FIELDS
) -> T:
    """Parse ``data`` as ``message_type`` or raise ``GRPCError``: INVALID_ARGUMENT for bytes
    that are not such a message, RESOURCE_EXHAUSTED for more than ``max_fields`` fields."""
    try:
        _check_message(data, message_type, "", 0, _Budget(max_fields))
        return cast(T, message_type.parse(data))  # type: ignore[attr-defined]
    except _TooManyFields:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"cannot decode {proto_name(message_type)}: more than {max_fields} fields "
            "(nested and packed ones included)",
        ) from None
    except _Malformed as exc:
        what = str(exc)
    except Exception as exc:  # betterproto2 raises KeyError, EOFError, ValueError, ...
        what = f"{type(exc).__name__}: {exc}"
    raise GRPCError(Status.INVALID_ARGUMENT, f"cannot decode {proto_name(message_type)}: {what}")


def proto_name(message_type: type[Any]) -> str:
    """``llmgw.v1.Cluster`` for ``Cluster``; the class name for unregistered classes."""
    url = default_message_pool.type_to_url.get(message_type)
    if url is None:
        return str(message_type.__name__)
    return str(url).rpartition("/")[2]


# --- the wire walk ---------------------------------------------------------------------


def _check_message(
    data: bytes, message_type: type[Any], path: str, depth: int, budget: _Budget
) -> None:
    if depth > _MAX_DEPTH:
        raise _Malformed(f"messages nested deeper than {_MAX_DEPTH} levels at {path}")
    meta = message_type._betterproto
    pos = 0
    while pos < len(data):
        budget.spend(1)
        number, wire_type, start, pos = _read_field(data, pos, path)
        name = meta.field_name_by_number.get(number)
        if name is None:
            continue  # unknown field (a newer peer): kept by betterproto2 as unknown bytes
        field_path = f"{path}{name}"
        field_meta = meta.meta_by_field_name[name]
        _check_wire_type(field_meta, wire_type, f"field {field_path} ({number})")
        if wire_type == betterproto2.WIRE_LEN_DELIM:
            nested = _nested_class(message_type, name, field_meta)
            _check_payload(field_meta, data[start:pos], nested, field_path, depth, budget)


def _read_field(data: bytes, pos: int, path: str) -> tuple[int, int, int, int]:
    """Read one tag and its value: (number, wire type, value start, value end)."""
    tag, pos = _read_varint(data, pos, path)
    number, wire_type = tag >> 3, tag & 0x7
    if number == 0:
        raise _Malformed(f"field number 0 {_where(path)}")
    start = pos
    if wire_type == betterproto2.WIRE_VARINT:
        _, pos = _read_varint(data, pos, path)
    elif wire_type == betterproto2.WIRE_FIXED_64:
        pos += 8
    elif wire_type == betterproto2.WIRE_FIXED_32:
        pos += 4
    elif wire_type == betterproto2.WIRE_LEN_DELIM:
        length, start = _read_varint(data, pos, path)
        pos = start + length
    else:
        raise _Malformed(f"field {path}{number} has unsupported wire type {wire_type}")
    if pos > len(data):
        raise _Malformed(f"field {path}{number} is truncated")
    return number, wire_type, start, pos


def _read_varint(data: bytes, pos: int, path: str) -> tuple[int, int]:
    value = 0
    for index in range(_MAX_VARINT_BYTES):
        if pos + index >= len(data):
            raise _Malformed(f"truncated varint {_where(path)}")
        byte = data[pos + index]
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            return value, pos + index + 1
    raise _Malformed(f"varint longer than {_MAX_VARINT_BYTES} bytes {_where(path)}")


def _where(path: str) -> str:
    return f"in {path.rstrip('.')}" if path else "at the top level"


def _check_wire_type(meta: betterproto2.FieldMetadata, wire_type: int, what: str) -> None:
    proto_type = meta.proto_type
    if wire_type == betterproto2.WIRE_LEN_DELIM and meta.repeated:
        allowed = True  # packed repeated scalars, and every length-delimited type
    elif proto_type in _VARINT_TYPES:
        allowed = wire_type == betterproto2.WIRE_VARINT
    elif proto_type in _FIXED32_TYPES:
        allowed = wire_type == betterproto2.WIRE_FIXED_32
    elif proto_type in _FIXED64_TYPES:
        allowed = wire_type == betterproto2.WIRE_FIXED_64
    else:
        allowed = wire_type == betterproto2.WIRE_LEN_DELIM
    if not allowed:
        raise _Malformed(f"{what} is {proto_type} but arrived as {_WIRE_NAMES[wire_type]}")


def _nested_class(
    message_type: type[Any], name: str, meta: betterproto2.FieldMetadata
) -> type[Any] | None:
    if meta.proto_type not in _NESTED_TYPES:
        return None
    if meta.unwrap is not None:
        return meta.unwrap()
    return cast(type[Any], message_type._betterproto.cls_by_field[name])


def _check_payload(
    meta: betterproto2.FieldMetadata,
    payload: bytes,
    nested: type[Any] | None,
    field_path: str,
    depth: int,
    budget: _Budget,
) -> None:
    """Check a length-delimited value: nested message, string, or packed scalars."""
    what = f"field {field_path} ({meta.number})"
    if nested is not None:
        _check_message(payload, nested, f"{field_path}.", depth + 1, budget)
    elif meta.proto_type == betterproto2.TYPE_STRING:
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Malformed(
                f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    elif meta.proto_type in _FIXED32_TYPES:
        if len(payload) % 4:
            raise _Malformed(f"{what}: packed length {len(payload)} is not a multiple of 4")
        budget.spend(len(payload) // 4)
    elif meta.proto_type in _FIXED64_TYPES:
        if len(payload) % 8:
            raise _Malformed(f"{what}: packed length {len(payload)} is not a multiple of 8")
        budget.spend(len(payload) // 8)
    elif meta.proto_type in _VARINT_TYPES:
        budget.spend(len(payload.translate(None, _CONTINUATION_BYTES)))  # one per varint
        pos = 0
        while pos < len(payload):
            _, pos = _read_varint(payload, pos, f"{field_path}.")


# --- grpclib -----------------------------------------------------------------------------


class CheckedProtoCodec(ProtoCodec):
    """grpclib's proto codec with ``decode_message`` and a receive size limit.

    The limit is enforced by the patched ``recv_message`` (``install_message_limit``), which
    reads ``max_message_bytes`` from the codec; constructing this codec installs it.
    """

    def __init__(
        self,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        max_fields: int = DEFAULT_MAX_FIELDS,
    ) -> None:
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be positive, not {max_message_bytes}")
        if max_fields <= 0:
            raise ValueError(f"max_fields must be positive, not {max_fields}")
        self.max_message_bytes = max_message_bytes
        self.max_fields = max_fields
        install_message_limit()

    def decode(self, data: bytes, message_type: type[IProtoMessage]) -> IProtoMessage:
        message = decode_message(data, message_type, max_fields=self.max_fields)
        message._llmgw_wire = data  # type: ignore[attr-defined]  # see wire_of
        return message


def wire_of(message: object) -> bytes | None:
    """The bytes a message received through ``CheckedProtoCodec`` was decoded from.

    A registration is re-sent to watchers and the store as it arrived, and encoding a
    large ``NodeInfo`` again costs milliseconds (``llmgw.server.state.encoded``); this lets the
    receiver reuse the bytes instead. None for messages that did not come through it.
    """
    wire = getattr(message, "_llmgw_wire", None)
    return wire if isinstance(wire, bytes) else None


def field_bytes(data: bytes, path: Sequence[int]) -> bytes | None:
    """The bytes of the embedded message at ``path`` (field numbers, outermost first) of
    well-formed message bytes; None when a field on the way is absent. Repeated
    occurrences are concatenated, which is how protobuf merges an embedded message."""
    for number in path:
        parts = []
        pos = 0
        while pos < len(data):
            field, wire_type, start, pos = _read_field(data, pos, "")
            if field == number and wire_type == betterproto2.WIRE_LEN_DELIM:
                parts.append(data[start:pos])
        if not parts:
            return None
        data = b"".join(parts)
    return data


async def _recv_message_with_limit(
    stream: Stream, codec: CodecBase, message_type: type[T]
) -> T | None:
    """``grpclib.stream.recv_message`` that refuses oversized and compressed messages."""
    try:
        prefix = await stream.recv_data(5)
        if not prefix:
            return None
        if prefix[0]:
            raise GRPCError(Status.UNIMPLEMENTED, "compressed messages are not supported")
        length = int.from_bytes(prefix[1:5], "big")
        limit = getattr(codec, "max_message_bytes", None)
        if limit is not None and length > limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"message of {length} bytes exceeds the limit of {limit} bytes",
            )
        data = await stream.recv_data(length)
    except AssertionError as exc:
        # grpclib's Buffer.read raises AssertionError when the stream ends mid-frame.
        raise GRPCError(Status.INVALID_ARGUMENT, "the stream ended inside a message") from exc
    return cast(T, codec.decode(data, message_type))


def install_message_limit() -> None:
    """Make grpclib's server honour ``max_message_bytes`` of its codec (idempotent)."""
    if getattr(grpclib.server, _PATCHED_NAME) is _recv_message_with_limit:
        return
    setattr(grpclib.server, _PATCHED_NAME, _recv_message_with_limit)
    logger.debug("grpclib.server.recv_message replaced with a size-limited version")
