"""This server's part in the leader lease (``llmgw.server.state.lease``): leading or not,
at which epoch, and who leads when it does not.

On PostgreSQL :meth:`Leadership.keep` claims the lease every ``renew_s`` while it leads and
every ``follow_s`` while it follows. It counts itself the leader only until
``ttl_s - margin_s`` after the claim that renewed it **began** (by its own monotonic clock),
so it stops leading before the database would let anyone else take over, even when its
process was frozen between the claim and now: :meth:`leading` is a clock comparison, true
only in that window, and every command and write checks it (the agents' stream stamps its
epoch on each message; the store's writes are fenced by it). A claim that fails (the
database gone) counts as not renewed.

On SQLite (:meth:`Leadership.sole`) the file's lock already makes this server the only one:
it takes the lease once at start (:meth:`Leadership.begin_term`, after the database's
contents are loaded), which moves the epoch on, and leads for good.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, replace

from llmgw.api.llmgw.v1 import Leadership as LeadershipMessage
from llmgw.api.llmgw.v1 import NotLeader
from llmgw.server.errors import StoreError
from llmgw.server.state.lease import NO_LEASE, LeaseView, claim_lease, release_lease
from llmgw.server.state.store import Store

log = logging.getLogger(__name__)

_NOBODY = ("", -1)  # a fence no write passes: this server does not lead


@dataclass(frozen=True, slots=True)
class LeaseTimes:
    """The lease's timing (``--lease-ttl``): a killed leader is replaced within about
    ``ttl_s + follow_s``."""

    ttl_s: float = 1.5  # the row's time to live by the database's clock
    renew_s: float = 0.25  # the leader's claims
    follow_s: float = 0.2  # a follower's claims
    margin_s: float = 0.4  # the leader stops this long before the row expires

    def __post_init__(self) -> None:
        if not self.ttl_s > self.margin_s + self.renew_s:
            raise ValueError(
                f"lease ttl {self.ttl_s}s leaves no time to renew: it must exceed "
                f"{self.margin_s + self.renew_s}s"
            )


class Leadership:
    """Whether this server leads now (:meth:`leading`), its epoch, and the lease as last read."""

    def __init__(
        self, store: Store, server_id: str, address: str, times: LeaseTimes = LeaseTimes()
    ) -> None:
        self.store = store
        self.server_id = server_id
        self.address = address
        self.times = times
        self.holder = f"{server_id}/{secrets.token_hex(6)}"  # this process, not only its id
        self.view: LeaseView = NO_LEASE  # the lease as last read (see :meth:`_lease_now`)
        self._view_at = 0.0  # monotonic: when it was read
        self.epoch = 0  # the epoch of this server's lease while it leads; else the last one
        self._until = 0.0  # monotonic: leading until then
        self._forever = False
        self.changed = asyncio.Event()  # set whenever leading() turns
        store.fence = _NOBODY

    @classmethod
    def sole(cls, store: Store, server_id: str, address: str) -> Leadership:
        """The only server of its database (SQLite's lock): it leads for good, unfenced
        until :meth:`begin_term` takes the lease."""
        self = cls(store, server_id, address)
        self._forever = True
        store.fence = None  # the file's lock already fences
        return self

    async def begin_term(self) -> None:
        """At the start of each term as the leader, once what the database holds is loaded
        (a start it stops wrote nothing): the sole server takes the lease, its epoch moved
        on. On PostgreSQL the keeper has already claimed it."""
        if not self._forever:
            return
        self.view = await self.store.take_lease(self.holder, self.server_id, self.address)
        self._view_at = time.monotonic()
        self.epoch = self.view.epoch
        log.info("leader of %s at epoch %d (one server per file)", self.store.path_text, self.epoch)

    def leading(self) -> bool:
        return self._forever or time.monotonic() < self._until

    def remaining_s(self) -> float:
        """How long this server still leads without another claim (0 when it does not)."""
        return float("inf") if self._forever else max(0.0, self._until - time.monotonic())

    async def keep(self) -> None:
        """Claim the lease for as long as the server runs (on PostgreSQL)."""
        was = False
        while True:
            began = time.monotonic()
            await self._claim(began)
            now = self.leading()
            if now != was:
                self._turned(now)
                was = now
            pause = self.times.renew_s if now else self.times.follow_s
            await asyncio.sleep(max(0.0, began + pause - time.monotonic()))

    async def _claim(self, began: float) -> None:
        times = self.times
        try:
            async with asyncio.timeout(times.ttl_s - times.margin_s):
                view = await claim_lease(
                    self.store.backend, self.holder, self.server_id, self.address,
                    int(times.ttl_s * 1000),
                )  # fmt: skip
        except (StoreError, TimeoutError, OSError) as exc:
            if self.leading():
                log.warning("could not renew the leader lease: %s", exc)
            return  # not renewed: leading() runs out by itself
        except Exception:  # a driver's surprise must not end the claims for good
            log.exception("the leader lease's claim failed; trying again")
            return
        self.view, self._view_at = view, time.monotonic()
        if view.held_by(self.holder):
            self._until = began + times.ttl_s - times.margin_s
            self.epoch = view.epoch
            self.store.fence = (self.holder, view.epoch)
        else:
            self._until = 0.0

    def _turned(self, leading: bool) -> None:
        if leading:
            log.info("leader of %s at epoch %d", self.store.path_text, self.epoch)
        else:
            self.store.fence = _NOBODY
            leader = self.view.server_id or "none"
            log.warning("not the leader now (epoch %d is %s's)", self.view.epoch, leader)
        self.changed.set()
        self.changed = asyncio.Event()

    async def wait_until(self, leading: bool) -> None:
        """Return once :meth:`leading` is ``leading`` (a lapse needs no claim to be seen)."""
        while self.leading() != leading:
            if leading:
                await self.changed.wait()
            else:
                await asyncio.sleep(min(0.05, self.remaining_s()))

    async def release(self) -> None:
        """Give the lease up (a clean stop): a follower takes over without waiting."""
        self._until, self._forever = 0.0, False
        self.store.fence = _NOBODY
        try:
            if await release_lease(self.store.backend, self.holder):
                log.info("the leader lease is released (epoch %d)", self.epoch)
        except StoreError as exc:
            log.warning("could not release the leader lease (it expires by itself): %s", exc)

    def not_leader(self) -> NotLeader:
        """Where the leader is, for a caller of this follower: nowhere while the lease is
        expired or names this server id (this process, taking the lead, or an earlier one,
        killed, its row not run out yet): naming this server's own address would send
        callers round from it to it."""
        view = self._lease_now()
        if view.remaining_ms <= 0 or view.server_id == self.server_id:
            view = NO_LEASE
        return NotLeader(
            leader_address=view.address, leader_epoch=view.epoch, leader_id=view.server_id,
            server_id=self.server_id,
        )  # fmt: skip

    def message(self) -> LeadershipMessage:
        """The answer's ``Cluster.leadership``."""
        leading = self.leading()
        view = self.view
        return LeadershipMessage(
            server_id=self.server_id,
            leader_id=self.server_id if leading else view.server_id,
            leader_address=self.address if leading else view.address,
            epoch=self.epoch if leading else view.epoch,
            leading=leading,
        )

    def _lease_now(self) -> LeaseView:
        """The lease as last read, its time left counted down since by this server's clock
        (a read from before a freeze says nothing about now)."""
        gone_ms = int((time.monotonic() - self._view_at) * 1000)
        return replace(self.view, remaining_ms=self.view.remaining_ms - gone_ms)

    def term_end(self) -> str:
        """Why a leader's term ends, as its agents' streams are told."""
        if self.leading():
            return "the control server is shutting down"
        return f"the control server no longer leads (its lease at epoch {self.epoch} ran out)"

    def refusal(self) -> str:
        """Why this server does not act, naming the leader (a follower's UNAVAILABLE)."""
        view = self.not_leader()
        own = self._lease_now()
        if own.server_id == self.server_id and own.remaining_ms > 0:
            which = "it is taking the lead" if own.holder == self.holder else (
                f"an earlier process of it holds the lease for {own.remaining_ms} ms more"
            )  # fmt: skip
            return f"server {self.server_id} does not lead yet: {which}; retry soon"
        if not view.leader_address:
            return f"server {self.server_id} does not lead, and no server leads now; retry soon"
        named = "" if view.leader_id == view.leader_address else f"{view.leader_id} "
        return (
            f"server {self.server_id} does not lead: the leader is {named}at "
            f"{view.leader_address} (epoch {view.leader_epoch})"
        )
