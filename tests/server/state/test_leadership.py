"""This server's part in the lease (``llmgw.server.state.leadership``): it leads after a
claim, stops by its own clock when claims fail, fences the store meanwhile, and follows a
lease another server holds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from llmgw.server.errors import Deposed, StoreError
from llmgw.server.state import leadership as module
from llmgw.server.state.leadership import Leadership, LeaseTimes
from llmgw.server.state.lease import claim_lease
from llmgw.server.state.store import Store

TIMES = LeaseTimes(ttl_s=0.8, renew_s=0.1, follow_s=0.1, margin_s=0.3)


async def test_a_leader_whose_claims_fail_stops_leading_by_its_own_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Store(tmp_path / "s.db") as store:
        lead = Leadership(store, "a", "h:1", TIMES)
        keeper = asyncio.create_task(lead.keep())
        try:
            await asyncio.wait_for(lead.wait_until(True), 2)
            assert lead.epoch == 1 and store.fence == (lead.holder, 1)
            await store.save_requests([("r1", "retire")])  # the leader writes

            async def unreachable(*args: object) -> object:
                raise StoreError("the database is gone")

            monkeypatch.setattr(module, "claim_lease", unreachable)
            began = time.monotonic()
            await asyncio.wait_for(lead.wait_until(False), 2)
            assert time.monotonic() - began <= TIMES.ttl_s - TIMES.margin_s + 0.05
            await asyncio.sleep(0.15)  # the keeper's next turn fences the store
            with pytest.raises(Deposed):
                await store.save_requests([("r2", "retire")])
        finally:
            keeper.cancel()


async def test_a_server_follows_a_lease_another_holds_and_names_the_leader(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:
        await claim_lease(store.backend, "b/1", "b", "h:2", 60_000)
        lead = Leadership(store, "a", "h:1", TIMES)
        keeper = asyncio.create_task(lead.keep())
        try:
            await asyncio.sleep(0.3)
            assert not lead.leading()
            assert lead.refusal() == "server a does not lead: the leader is b at h:2 (epoch 1)"
            told = lead.not_leader()
            assert (told.leader_address, told.leader_epoch, told.server_id) == ("h:2", 1, "a")
            assert lead.message().leader_id == "b" and not lead.message().leading
        finally:
            keeper.cancel()


def test_a_ttl_that_leaves_no_time_to_renew_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves no time to renew"):
        LeaseTimes(ttl_s=0.5)


async def test_a_lease_an_earlier_process_of_this_server_holds_names_no_leader(
    tmp_path: Path,
) -> None:
    async with Store(tmp_path / "s.db") as store:
        await claim_lease(store.backend, "a/killed", "a", "h:1", 60_000)  # kill -9, restarted
        lead = Leadership(store, "a", "h:1", TIMES)
        keeper = asyncio.create_task(lead.keep())
        try:
            await asyncio.sleep(0.3)
            assert not lead.leading()
            told = lead.not_leader()
            assert told.leader_address == "" and told.server_id == "a"  # never itself
            assert "an earlier process of it holds the lease" in lead.refusal()
        finally:
            keeper.cancel()


async def test_a_lease_read_before_a_freeze_names_no_leader_after_it(tmp_path: Path) -> None:
    async with Store(tmp_path / "s.db") as store:
        await claim_lease(store.backend, "b/1", "b", "h:2", 500)
        lead = Leadership(store, "a", "h:1", TIMES)
        keeper = asyncio.create_task(lead.keep())
        await asyncio.sleep(0.15)
        keeper.cancel()  # frozen: no claim reads the lease again
        assert lead.not_leader().leader_address == "h:2"
        await asyncio.sleep(0.6)  # b's lease ran out meanwhile, by any clock
        assert lead.not_leader().leader_address == ""
        assert "no server leads now" in lead.refusal()
