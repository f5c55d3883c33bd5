"""A follower's in-server gateway (issue #17): ``run_gateway`` embedded in the control server,
on the leader's router feed, as a separate gateway would be.

It starts from the follower's own native port, which names the leader (``not_leader``), and
follows the leader's feed wherever it moves (``ServerList(follow_any_leader=True)``: one slot
for the named leader), reporting its figures there. With authentication on it calls with a
``gateway`` token of its own, stored (hashed) for the follower's turn only
(:func:`turn_token`); with authentication off it makes none, as a token would turn
authentication on for the whole cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

from llmgw.addresses import parse_host_port
from llmgw.gateway import GatewayConfig, run_gateway
from llmgw.server.errors import StoreError
from llmgw.server.state.leadership import Leadership
from llmgw.server.state.tokens import Role
from llmgw.server.wire.auth import Authenticator, hash_token, new_token

__all__ = [
    "TURN_TOKEN_NOTE",
    "TURN_TOKEN_RETRY_S",
    "follow_leader_gateway",
    "own_address",
    "turn_token",
]

log = logging.getLogger(__name__)


async def follow_leader_gateway(
    config: GatewayConfig,
    stop: asyncio.Event,
    leadership: Leadership,
    auth: Authenticator,
    *,
    feed_tls: ssl.SSLContext | None,
) -> None:
    """Serve the gateway on ``config`` until ``stop``, its feed starting from this server's
    own native port (:func:`own_address`) over ``feed_tls``, reporting as ``server ID``."""
    async with turn_token(leadership, auth, stop) as token:
        if stop.is_set():
            return
        await run_gateway(
            [own_address(leadership)],
            config,
            stop,
            token=token,
            feed_tls=feed_tls,
            gateway_id=f"server {leadership.server_id}",
            embedded=True,
        )


def own_address(leadership: Leadership) -> tuple[str, int]:
    """Where this server's own native port is dialled: the address it advertises
    (``--advertise``, else ``--grpc-listen``), a wildcard host as loopback."""
    host, port = parse_host_port(leadership.address, port_zero=True)
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host), port


TURN_TOKEN_NOTE = "llmgw server {}: its own gateway's feed while it follows"
"""The note of a follower's gateway token (``llmgw token list`` shows it); one per server id."""


TURN_TOKEN_RETRY_S = 5.0
"""How soon a follower tries again to store its gateway's token when the database refused."""


@contextlib.asynccontextmanager
async def turn_token(
    leadership: Leadership, auth: Authenticator, stop: asyncio.Event
) -> AsyncIterator[str | None]:
    """A gateway token for this follower's turn, None while authentication is off (a token
    would turn it on for the whole cluster). Only its hash is stored, under
    :data:`TURN_TOKEN_NOTE`; one a killed process of this server id left is replaced, and
    the token is deleted when the turn ends. While the database refuses, it tries again
    every :data:`TURN_TOKEN_RETRY_S` until ``stop`` (then None: the turn is over)."""
    if not await auth.enabled():
        yield None
        return
    store = leadership.store
    note = TURN_TOKEN_NOTE.format(leadership.server_id)
    token = new_token()
    while True:
        try:
            for stale in await store.load_tokens():
                if stale.note == note:
                    await store.delete_token(stale.token_id)
            token_id = await store.add_token(Role.GATEWAY, hash_token(token), note)
            break
        except StoreError as exc:
            log.warning("the follower's gateway waits for its token: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TURN_TOKEN_RETRY_S)
            if stop.is_set():
                yield None
                return
    try:
        yield token
    finally:
        try:
            await store.delete_token(token_id)
        except StoreError as exc:  # the database is away: the next turn replaces it
            log.warning("the follower's gateway token %d is not deleted: %s", token_id, exc)
