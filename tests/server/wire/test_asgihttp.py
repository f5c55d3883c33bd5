"""An ASGI application on ``HttpServer`` (llmgw.server.wire.asgihttp), over raw sockets: the
framings a response can take, and an application that fails or leaves its response open."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from llmgw.gateway.httplimits import ServerLimits
from llmgw.gateway.httpserver import HttpServer
from llmgw.server.wire.asgihttp import AsgiHandler

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


async def streaming(scope: MutableMapping[str, Any], receive: Any, send: Send) -> None:
    """Echoes the body, then two more parts; the path picks the way to go wrong."""
    body = (await receive())["body"]
    if scope["path"] == "/raise":
        raise RuntimeError("a bug")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1")]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    if scope["path"] == "/unfinished":
        return
    await send({"type": "http.response.body", "body": b"-two", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    server = HttpServer(AsgiHandler(streaming), ServerLimits())
    _, port = await server.start("127.0.0.1", 0)
    try:
        yield port
    finally:
        await server.stop()


async def exchange(port: int, raw: bytes) -> bytes:
    """Everything the server sends until it closes or goes quiet for 0.5 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    out = bytearray()
    try:
        while data := await asyncio.wait_for(reader.read(65536), 0.5):
            out += data
    except TimeoutError:
        pass
    writer.close()
    return bytes(out)


async def test_a_streamed_response_is_chunked_to_http11_and_the_connection_kept() -> None:
    async with serving() as port:
        answer = await exchange(
            port, b"POST /s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 3\r\n\r\none"
        )
    assert answer.startswith(b"HTTP/1.1 200 OK\r\nx-a: 1\r\ntransfer-encoding: chunked\r\n")
    assert answer.endswith(b"\r\n\r\n3\r\none\r\n4\r\n-two\r\n0\r\n\r\n")


async def test_a_streamed_response_to_http10_ends_with_the_connection() -> None:
    async with serving() as port:
        answer = await exchange(port, b"POST /s HTTP/1.0\r\ncontent-length: 3\r\n\r\none")
    assert b"transfer-encoding" not in answer
    assert b"connection: close\r\n" in answer
    assert answer.endswith(b"\r\n\r\none-two")


async def test_head_gets_the_headers_alone() -> None:
    async with serving() as port:
        answer = await exchange(port, b"HEAD /s HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b"transfer-encoding: chunked\r\n\r\n")


async def test_an_application_that_raises_answers_500() -> None:
    async with serving() as port:
        answer = await exchange(port, b"GET /raise HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 500 ")
    assert b"connection: close\r\n" in answer


async def test_an_unfinished_response_closes_the_connection() -> None:
    async with serving() as port:
        answer = await exchange(
            port, b"POST /unfinished HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 1\r\n\r\nx"
        )
    assert answer.endswith(b"\r\n1\r\nx\r\n")  # no last chunk: the client sees it cut short
