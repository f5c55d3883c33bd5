"""The chaos run with several servers on one PostgreSQL (``--servers N``, N >= 2).

* `read_leaders`: each server's ``/metrics`` ``llmgw_leader`` and ``llmgw_leader_epoch``.
* `LeaderClient`: the three ControlService calls the run makes, asked of each server in turn
  until one answers (a follower refuses with UNAVAILABLE naming the leader: ask the next).
* `choose_server`: a server fault's target, the current leader most of the time.
* `wait_failover`: from a fault on the leader until another server says it leads at a
  higher epoch.
* `Postgres`: the run's private PostgreSQL killed (``pg_ctl stop -m immediate``) and started
  again, or its postmaster's process group SIGSTOPped and SIGCONTed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TypeVar

import httpx

from bench.pgcluster import PrivateCluster
from llmgw.api.llmgw.v1 import ActionResult, ApplyDeploymentRequest, Cluster, EngineProfile
from llmgw.client import ClientError, ControlClient, GrpcWebChannel
from llmgw.client.channel import Timeouts
from llmgw.promtext import metric_samples

_T = TypeVar("_T")

LEADER_SHARE = 0.75  # of server faults, the share aimed at the leader (when one is known)
FAILOVER_TIMEOUT_S = 30.0

Leaders = dict[str, tuple[int, int]]  # server name → (llmgw_leader, llmgw_leader_epoch)


def parse_leader(metrics_text: str) -> tuple[int, int] | None:
    """(llmgw_leader, llmgw_leader_epoch) from a ``/metrics`` page; None when absent."""
    leading = metric_samples(metrics_text, "llmgw_leader")
    epoch = metric_samples(metrics_text, "llmgw_leader_epoch")
    if not leading or not epoch:
        return None
    return int(leading[0][1]), int(epoch[0][1])


async def read_leaders(http: httpx.AsyncClient, webs: Mapping[str, str]) -> Leaders:
    """Every answering server's (leader, epoch), by name (one that does not answer is left
    out); the servers are asked at once, so the answers are of about one moment."""

    async def one(url: str) -> tuple[int, int] | None:
        with contextlib.suppress(httpx.HTTPError, ValueError, IndexError):
            answer = await http.get(f"{url}/metrics", timeout=0.5)
            if answer.status_code == 200:
                return parse_leader(answer.text)
        return None

    names = list(webs)
    found = await asyncio.gather(*(one(webs[n]) for n in names))
    return {n: v for n, v in zip(names, found, strict=True) if v is not None}


def leader_of(seen: Leaders) -> tuple[str, int] | None:
    """The (name, epoch) of the server that says it leads at the highest epoch; None: none."""
    leading = [(epoch, name) for name, (lead, epoch) in seen.items() if lead]
    if not leading:
        return None
    epoch, name = max(leading)
    return name, epoch


def choose_server(
    names: Sequence[str], leader: str | None, rng: random.Random, leader_share: float = LEADER_SHARE
) -> str:
    """A server fault's target: the leader with probability ``leader_share`` (when there is
    one), else one of the others at random."""
    if not names:
        raise ValueError("no servers to choose from")
    if leader is None or leader not in names:
        return rng.choice(list(names))
    others = [n for n in names if n != leader]
    if not others or rng.random() < leader_share:
        return leader
    return rng.choice(others)


async def wait_failover(
    http: httpx.AsyncClient,
    others: Mapping[str, str],
    epoch: int,
    timeout_s: float = FAILOVER_TIMEOUT_S,
    poll_s: float = 0.1,
) -> float | None:
    """Seconds until one of ``others`` (name → web URL) says it leads at an epoch above
    ``epoch``; None when none does within ``timeout_s``."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        found = leader_of(await read_leaders(http, others))
        if found is not None and found[1] > epoch:
            return time.monotonic() - began
        await asyncio.sleep(poll_s)
    return None


class LeaderClient:
    """get_cluster, list_profiles and apply_deployment asked of each server's web URL in
    turn, the one that answered last first; the last server's error when none answers."""

    def __init__(self, webs: Sequence[str], timeouts: Timeouts) -> None:
        if not webs:
            raise ValueError("LeaderClient needs at least one server URL")
        self._webs = list(webs)
        self._timeouts = timeouts
        self._stack = AsyncExitStack()
        self._clients: list[ControlClient] = []
        self._first = 0

    async def __aenter__(self) -> LeaderClient:
        for web in self._webs:
            channel = await self._stack.enter_async_context(
                GrpcWebChannel(web, timeouts=self._timeouts)
            )
            self._clients.append(ControlClient(channel))
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    def _order(self) -> list[int]:
        n = len(self._clients)
        return [(self._first + i) % n for i in range(n)]

    async def _ask(self, call: Callable[[ControlClient], Awaitable[_T]]) -> _T:
        """``call`` on each server in turn, from the one that answered last, until one
        answers (a follower refuses); the last refusal when none does."""
        error: ClientError | None = None
        for i in self._order():
            try:
                found = await call(self._clients[i])
            except ClientError as exc:
                error = exc
                continue
            self._first = i
            return found
        assert error is not None
        raise error

    async def get_cluster(self) -> Cluster:
        return await self._ask(lambda client: client.get_cluster())

    async def list_profiles(self) -> list[EngineProfile]:
        return await self._ask(lambda client: client.list_profiles())

    async def apply_deployment(self, request: ApplyDeploymentRequest) -> ActionResult:
        return await self._ask(lambda client: client.apply_deployment(request))


def postmaster_pid(data: os.PathLike[str] | str) -> int:
    """The postmaster's pid: the first line of DATA/postmaster.pid (ValueError if absent)."""
    path = os.path.join(data, "postmaster.pid")
    try:
        with open(path, encoding="ascii") as f:
            return int(f.readline().strip())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no postmaster pid ({exc})") from None


class Postgres:
    """The run's private PostgreSQL as a fault target."""

    def __init__(self, cluster: PrivateCluster) -> None:
        self.cluster = cluster

    def pid(self) -> int:
        return postmaster_pid(self.cluster.data)

    async def kill(self, down_s: float) -> int:
        """``pg_ctl stop -m immediate`` (as a crash), ``down_s`` later started again; the
        postmaster's pid it had."""
        pid = self.pid()
        await asyncio.to_thread(self.cluster.stop, "immediate")
        try:
            await asyncio.sleep(down_s)
        finally:
            await asyncio.to_thread(self.cluster.start)
        return pid

    async def hang(self, stop_s: float) -> int:
        """SIGSTOP the postmaster's process group, ``stop_s`` later SIGCONT (always)."""
        pid = self.pid()
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGSTOP)
        try:
            await asyncio.sleep(stop_s)
        finally:
            os.killpg(group, signal.SIGCONT)
        return pid
