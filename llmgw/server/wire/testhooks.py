"""Test hooks of the control server: ``llmgw server --test-hooks`` (off by default).

For tests that drive agents by hand; the server turns its reconciler off with it, since
the reconciler would stop shards that no deployment wants.
``POST /debug/agents/{node_id}/command`` on the gRPC-web (HTTP) port takes one
``ControlMessage`` in proto3 JSON holding exactly one of ``startShard``, ``stopShard`` or
``drainShard``, and sends it down that node's agent stream::

    curl -X POST http://127.0.0.1:8080/debug/agents/n1/command \\
        -d '{"stopShard": {"shardId": "r1-0", "graceSeconds": 10}}'

Answers (JSON): 200 ``{"sent": true}``; 400 with ``{"error": …}`` saying what is wrong with
the body; 404 when no agent of that node is connected; 405 for another method. Every other
request goes to the wrapped application unchanged. There is no authentication: never enable
the hooks on a server that anyone else can reach.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

from llmgw.api.llmgw.v1 import ControlMessage

__all__ = ["COMMAND_PATH", "AgentCommandHook"]

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
AsgiMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[AsgiMessage]]
Send = Callable[[AsgiMessage], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
SendCommand = Callable[[str, ControlMessage], Awaitable[bool]]

COMMAND_PATH: Final = re.compile(r"^/debug/agents/([A-Za-z0-9][A-Za-z0-9._-]{0,252})/command$")
_COMMANDS: Final = {
    "startShard": "startShard",
    "start_shard": "startShard",
    "stopShard": "stopShard",
    "stop_shard": "stopShard",
    "drainShard": "drainShard",
    "drain_shard": "drainShard",
}
MAX_BODY_BYTES: Final = 1 << 20


class _BadRequest(Exception):
    """The hook's body is not one command; the message says why."""


class AgentCommandHook:
    """ASGI middleware: the command hook in front of ``app``."""

    def __init__(self, app: App, send_command: SendCommand) -> None:
        self._app = app
        self._send_command = send_command

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = COMMAND_PATH.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            await self._app(scope, receive, send)
        elif scope["method"] != "POST":
            await _json(send, 405, {"error": "use POST"}, allow=b"POST")
        else:
            await self._command(match.group(1), receive, send)

    async def _command(self, node_id: str, receive: Receive, send: Send) -> None:
        try:
            message = parse_command(await _read_body(receive))
        except _BadRequest as exc:
            await _json(send, 400, {"error": str(exc)})
            return
        if not await self._send_command(node_id, message):
            await _json(send, 404, {"error": f"node {node_id!r} has no agent connected"})
            return
        log.info("test hook: sent %s to node %s", next(iter(message.to_dict())), node_id)
        await _json(send, 200, {"sent": True})


def parse_command(body: bytes) -> ControlMessage:
    """The ControlMessage in ``body``; _BadRequest unless it holds exactly one command."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise _BadRequest(f"the body is not JSON: {exc}") from exc
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in _COMMANDS:
        raise _BadRequest(
            "the body must be a ControlMessage holding exactly one of "
            "startShard, stopShard, drainShard"
        )
    try:
        return ControlMessage.from_dict(data)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise _BadRequest(f"not a valid ControlMessage: {exc}") from exc


async def _read_body(receive: Receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _BadRequest("the client went away")
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise _BadRequest(f"the body is larger than {MAX_BODY_BYTES} bytes")
        if not message.get("more_body", False):
            return bytes(body)


async def _json(send: Send, status: int, payload: object, *, allow: bytes = b"") -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if allow:
        headers.append((b"allow", allow))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
