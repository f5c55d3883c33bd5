"""One gRPC-web call of ``grpcweb.GrpcWebApp``, once its request is read: the stream object
handed to grpclib's generated handlers in place of its HTTP/2 stream (``WebStream``, with
``Peer``), the call's HTTP reply (``Reply``: headers on the first frame, the trailer frame
last), and running the handler to its status (``invoke``) until the client goes away
(``run_until_disconnect``). The ASGI types of the bridge (``Scope``, ``Receive``, ``Send``,
``Headers``) are here too.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from typing import Any, Final

from grpclib.const import Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, encode_grpc_message
from multidict import MultiDict

from llmgw.server.wire.codec import decode_message

__all__ = [
    "DATA_FLAG",
    "AsgiMessage",
    "Headers",
    "Peer",
    "Receive",
    "Reply",
    "Scope",
    "Send",
    "WebStream",
    "invoke",
    "run_until_disconnect",
]

logger = logging.getLogger("llmgw.server.wire.grpcweb")  # the bridge's records, wherever made

Scope = MutableMapping[str, Any]
AsgiMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[AsgiMessage]]
Send = Callable[[AsgiMessage], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

DATA_FLAG: Final = 0x00
_TRAILER_FLAG: Final = 0x80


# --- the stream handed to generated handlers ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Peer:
    """The client's address, like ``grpclib.protocol.Peer``."""

    address: tuple[str, int] | None

    def addr(self) -> tuple[str, int] | None:
        return self.address

    def cert(self) -> None:
        return None


class WebStream:
    """What generated handlers and our services use of ``grpclib.server.Stream``."""

    def __init__(
        self,
        *,
        payload: bytes,
        handler: Handler,
        reply: Reply,
        metadata: MultiDict[str | bytes],
        peer: Peer,
        deadline: Deadline | None,
        user_agent: str | None,
    ) -> None:
        self.metadata = metadata
        self.peer = peer
        self.deadline = deadline
        self.user_agent = user_agent
        self.messages_sent = 0
        self.trailing: tuple[Status, str | None] | None = None
        self._payload: bytes | None = payload
        self._handler = handler
        self._reply = reply

    async def recv_message(self) -> Any:
        """The request, decoded on the first call; None afterwards."""
        payload, self._payload = self._payload, None
        if payload is None:
            return None
        return decode_message(payload, self._handler.request_type)

    async def send_initial_metadata(self, *, metadata: object = None) -> None:
        await self._reply.start()

    async def send_message(self, message: Any) -> None:
        if not self._handler.cardinality.server_streaming and self.messages_sent:
            raise RuntimeError("a unary method sent a second reply")
        await self._reply.frame(DATA_FLAG, bytes(message))
        self.messages_sent += 1

    async def send_trailing_metadata(
        self,
        *,
        status: Status = Status.OK,
        status_message: str | None = None,
        status_details: object = None,
        metadata: object = None,
    ) -> None:
        """Remember the status: the trailer frame is written when the handler returns."""
        self.trailing = (status, status_message)

    def outcome(self) -> tuple[Status, str | None]:
        """The status of a handler that returned normally."""
        if self.trailing is not None:
            return self.trailing
        if not self._handler.cardinality.server_streaming and not self.messages_sent:
            logger.error("handler %s returned without a reply", self._handler.func)
            return Status.INTERNAL, "internal error"
        return Status.OK, None


class Reply:
    """The HTTP response of one call: headers on the first frame, the trailer frame last."""

    def __init__(self, send: Send, *, text: bool, content_type: str, cors: Headers) -> None:
        self.text = text
        self._send = send
        self._headers = [(b"content-type", content_type.encode("latin-1")), *cors]
        self._started = False

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self._send(
                {"type": "http.response.start", "status": 200, "headers": self._headers}
            )

    async def frame(self, flag: int, payload: bytes) -> None:
        await self.start()
        await self._send(
            {"type": "http.response.body", "body": self._encode(flag, payload), "more_body": True}
        )

    async def finish(self, status: Status, message: str | None) -> None:
        trailer = f"grpc-status:{status.value}\r\n"
        if message:
            trailer += f"grpc-message:{encode_grpc_message(message)}\r\n"
        await self.start()
        body = self._encode(_TRAILER_FLAG, trailer.encode("ascii"))
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    def _encode(self, flag: int, payload: bytes) -> bytes:
        frame = bytes([flag]) + len(payload).to_bytes(4, "big") + payload
        return base64.b64encode(frame) if self.text else frame


# --- running a handler -------------------------------------------------------------------


async def invoke(handler: Handler, stream: WebStream, path: str) -> tuple[Status, str | None]:
    """Run one handler to its status; never raises except for cancellation."""
    remaining = None if stream.deadline is None else stream.deadline.time_remaining()
    timeout = asyncio.timeout(remaining)
    try:
        async with timeout:
            await handler.func(stream)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        if timeout.expired():
            return Status.DEADLINE_EXCEEDED, "deadline exceeded"
        logger.exception("handler of %s failed", path)
        return Status.INTERNAL, "internal error"
    except GRPCError as exc:
        return exc.status, exc.message
    except Exception:
        logger.exception("handler of %s failed", path)
        return Status.INTERNAL, "internal error"
    return stream.outcome()


async def run_until_disconnect(
    work: Coroutine[Any, Any, tuple[Status, str | None]], receive: Receive
) -> tuple[Status, str | None] | None:
    """Await ``work``, cancelling it when the client disconnects (then None)."""
    async with asyncio.TaskGroup() as group:
        call = group.create_task(work)
        gone = group.create_task(_wait_for_disconnect(receive))
        await asyncio.wait((call, gone), return_when=asyncio.FIRST_COMPLETED)
        (call if gone.done() else gone).cancel()
    if call.cancelled():
        logger.debug("client went away; call cancelled")
        return None
    return call.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
