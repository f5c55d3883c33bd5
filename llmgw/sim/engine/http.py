"""A small ASGI layer: requests, JSON and streamed responses, routing and vLLM's API-key check.

Just what the simulated OpenAI server needs, kept cheap per request (benchmarks pay for it).
Errors a handler raises as `RequestError` become vLLM's error JSON here; anything else is
logged and answers 500. A handler can ask to hear about the client going away
(`HttpRequest.on_disconnect`), which is how an abandoned generation gets aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from llmgw.sim.engine.errors import RequestError

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
JSON_TYPE = b"application/json"
SSE_TYPE = b"text/event-stream; charset=utf-8"
MAX_BODY = 64 << 20


def dumps(value: Any) -> bytes:
    """Compact JSON, as Starlette's ``JSONResponse`` writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(slots=True)
class Response:
    """A whole response."""

    status: int = 200
    body: bytes = b""
    content_type: bytes | None = JSON_TYPE

    @classmethod
    def json(cls, value: Any, status: int = 200) -> Response:
        return cls(status, dumps(value))


@dataclass(slots=True)
class StreamResponse:
    """A response sent chunk by chunk as ``chunks`` yields (server-sent events)."""

    chunks: AsyncGenerator[bytes, None]
    status: int = 200
    content_type: bytes = SSE_TYPE


@dataclass(slots=True)
class HttpRequest:
    """One request: its scope, its whole body, and a way to hear of a disconnect."""

    scope: Scope
    receive: Receive
    body: bytes = b""
    _watch: asyncio.Task[None] | None = field(default=None, repr=False)
    _after: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    @property
    def path(self) -> str:
        return str(self.scope["path"])

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.scope["headers"]:
            if key.lower() == name:
                return bytes(value)
        return None

    def json(self) -> dict[str, Any]:
        """The body as a JSON object; a 400 like vLLM's otherwise."""
        try:
            value = json.loads(self.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise RequestError(400, "the request body must be a JSON object")
        return value

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once if the client goes away before the response ends."""
        if self._watch is None:
            self._watch = asyncio.create_task(self._wait_disconnect(callback))

    async def _wait_disconnect(self, callback: Callable[[], None]) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                callback()
                return

    def after_response(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the response has been sent (or the client has gone)."""
        self._after.append(callback)

    async def finish(self) -> None:
        for callback in self._after:
            callback()
        self._after.clear()
        task, self._watch = self._watch, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


Handler = Callable[[HttpRequest], Awaitable[Response | StreamResponse]]


def error_body(exc: RequestError) -> Response:
    """vLLM's OpenAI error JSON."""
    return Response.json(
        {
            "error": {
                "message": exc.message,
                "type": exc.error_type,
                "param": exc.param,
                "code": exc.status,
            }
        },
        exc.status,
    )


class Router:
    """The ASGI app: dispatch by path and method, guard ``/v1`` with the API keys."""

    def __init__(self, routes: Mapping[str, Mapping[str, Handler]], api_keys: tuple[str, ...]):
        self._routes = routes
        self._key_digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await _lifespan(receive, send)
            return
        request = HttpRequest(scope, receive)
        try:
            response = await self._respond(request)
            await _send(send, response)
        finally:
            await request.finish()

    async def _respond(self, request: HttpRequest) -> Response | StreamResponse:
        if not self._authorized(request):
            return Response.json({"error": "Unauthorized"}, 401)
        methods = self._routes.get(request.path)
        if methods is None:
            return Response.json({"detail": "Not Found"}, 404)
        handler = methods.get(request.method)
        if handler is None:
            return Response.json({"detail": "Method Not Allowed"}, 405)
        try:
            request.body = await _read_body(request.receive)
            return await handler(request)
        except RequestError as exc:
            return error_body(exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("error handling %s %s", request.method, request.path)
            return error_body(RequestError(500, "internal error in the simulated engine"))

    def _authorized(self, request: HttpRequest) -> bool:
        """vLLM's ``AuthenticationMiddleware``: only paths under ``/v1``, Bearer scheme."""
        if not self._key_digests or request.method == "OPTIONS":
            return True
        if not request.path.startswith("/v1"):
            return True
        value = (request.header(b"authorization") or b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any(hmac.compare_digest(digest, known) for known in self._key_digests)


async def _read_body(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError(400, "the client went away before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise RequestError(400, f"the request body is larger than {MAX_BODY} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _send(send: Send, response: Response | StreamResponse) -> None:
    headers = [] if response.content_type is None else [(b"content-type", response.content_type)]
    try:
        if isinstance(response, Response):
            headers.append((b"content-length", str(len(response.body)).encode()))
            await send(
                {"type": "http.response.start", "status": response.status, "headers": headers}
            )
            await send({"type": "http.response.body", "body": response.body})
            return
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        async for chunk in response.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    except OSError as exc:  # uvicorn's ClientDisconnected: the client went away
        log.debug("response not sent in full: %s", exc)
    finally:
        if isinstance(response, StreamResponse):
            await response.chunks.aclose()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
