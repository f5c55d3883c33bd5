"""Leader failover of servers sharing one PostgreSQL database (issue #17).

    python -m bench.failover [--servers 3] [--rounds 20] [--lease-ttl 1.5]

Starts a private PostgreSQL cluster (``bench/pgcluster.py``) and ``--servers`` real
``llmgw server`` processes on it, then, ``--rounds`` times, takes the leader down, in turn
with ``kill -9`` and with SIGSTOP, and measures the **failover**: from the signal to another
server's ``/metrics`` saying ``llmgw_leader 1`` at a higher epoch (it then serves as the
leader: its term has loaded the plane and bound its ports). A killed server is started
again (it joins as a follower); a stopped one gets SIGCONT once the new leader serves, and
the bench measures how long until it says ``llmgw_leader 0`` (a woken leader knowing it was
deposed). Every poll also counts the servers that say they lead: two at once would be a
split brain, and the bench fails on one. Prints p50 and max per kind of fault.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from bench.pgcluster import PrivateCluster, find_bindir, private_cluster
from llmgw.addresses import free_port
from llmgw.promtext import metric_samples

POLL_S = 0.02


@dataclass
class Server:
    """One ``llmgw server`` process of the bench."""

    name: str
    root: Path
    db: str
    lease_ttl: float
    grpc: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.root / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "server", "--db", self.db, "--gateway-listen", "off",
             "--grpc-listen", f"127.0.0.1:{self.grpc}", "--http-listen", f"127.0.0.1:{self.http}",
             "--server-id", self.name, "--lease-ttl", str(self.lease_ttl)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()

    def leader(self, client: httpx.Client) -> tuple[int, int] | None:
        """(llmgw_leader, llmgw_leader_epoch), or None while it does not answer."""
        try:
            answer = client.get(f"http://127.0.0.1:{self.http}/metrics", timeout=0.5)
        except httpx.HTTPError:
            return None
        if answer.status_code != 200:
            return None
        leading = metric_samples(answer.text, "llmgw_leader")
        epoch = metric_samples(answer.text, "llmgw_leader_epoch")
        return int(leading[0][1]), int(epoch[0][1])

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class SplitBrain(AssertionError):
    """Two servers said they lead at the same moment."""


def _poll(servers: Sequence[Server], client: httpx.Client) -> dict[str, tuple[int, int]]:
    seen = {s.name: v for s in servers if (v := s.leader(client)) is not None}
    leading = [(name, epoch) for name, (lead, epoch) in seen.items() if lead]
    if len(leading) > 1:
        raise SplitBrain(f"two servers lead at once: {leading}")
    return seen


Seen = dict[str, tuple[int, int]]


def _wait(
    servers: Sequence[Server], client: httpx.Client, done: Callable[[Seen], bool], timeout_s: float
) -> float:
    """Seconds until ``done(seen)`` holds (polling every POLL_S, split brain checked)."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        if done(_poll(servers, client)):
            return time.monotonic() - began
        time.sleep(POLL_S)
    raise TimeoutError(f"nothing after {timeout_s}s")


def _leader(seen: dict[str, tuple[int, int]]) -> tuple[str, int] | None:
    return next(((n, e) for n, (lead, e) in seen.items() if lead), None)


def _led_after(epoch: int, seen: Seen) -> bool:
    return (_leader(seen) or ("", 0))[1] > epoch


def _follows(name: str, seen: Seen) -> bool:
    return seen.get(name, (1, 0))[0] == 0


def run(servers: list[Server], rounds: int) -> dict[str, list[float]]:
    """The rounds: each fault on the leader, its failover (and a woken leader's deposal)."""
    figures: dict[str, list[float]] = {"kill -9": [], "SIGSTOP": [], "woken knows": []}
    by_name = {s.name: s for s in servers}
    with httpx.Client() as client:
        _wait(
            servers,
            client,
            lambda seen: _leader(seen) is not None and len(seen) == len(servers),
            30,
        )
        for n in range(rounds):
            name, epoch = _leader(_poll(servers, client)) or ("", 0)
            victim = by_name[name]
            kind = "kill -9" if n % 2 == 0 else "SIGSTOP"
            victim.signal(signal.SIGKILL if kind == "kill -9" else signal.SIGSTOP)
            others = [s for s in servers if s is not victim]
            took = _wait(others, client, partial(_led_after, epoch), 15)
            figures[kind].append(took)
            if kind == "kill -9":
                victim.start()
            else:
                victim.signal(signal.SIGCONT)
                figures["woken knows"].append(
                    _wait(servers, client, partial(_follows, victim.name), 15)
                )
            _wait(servers, client, lambda seen: len(seen) == len(servers), 30)  # all back
            print(f"round {n + 1}: {kind} of {name} (epoch {epoch}): a new leader in {took:.2f}s",
                  flush=True)  # fmt: skip
    return figures


def database_outage(servers: list[Server], cluster: PrivateCluster) -> tuple[float, float]:
    """PostgreSQL itself killed (``pg_ctl stop -m immediate``, as a crash) and started again:
    (seconds until no server says it leads, seconds from the restart to a leader again)."""
    with httpx.Client() as client:
        cluster.stop("immediate")
        gone = _wait(servers, client, lambda seen: _leader(seen) is None, 15)
        cluster.start()
        back = _wait(servers, client, lambda seen: _leader(seen) is not None, 30)
    return gone, back


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--lease-ttl", type=float, default=1.5)
    args = p.parse_args(argv)
    bindir = find_bindir()
    if bindir is None:
        print("PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="llmgw-failover-"))
    os.chmod(root, 0o700)
    with private_cluster(bindir) as cluster:
        db = cluster.url("postgres")
        servers = [Server(f"s{i}", root, db, args.lease_ttl) for i in range(args.servers)]
        try:
            for server in servers:
                server.start()
            figures = run(servers, args.rounds)
            gone, back = database_outage(servers, cluster)
        finally:
            for server in servers:
                server.stop()
    print(f"\n{args.servers} servers, lease ttl {args.lease_ttl}s, logs in {root}")
    print("| fault | n | p50 s | max s |\n|---|---|---|---|")
    for kind, values in figures.items():
        if values:
            print(
                f"| {kind} | {len(values)} | {statistics.median(values):.2f} | {max(values):.2f} |"
            )
    print(
        f"PostgreSQL killed: no server leads after {gone:.2f}s;"
        f" restarted: a leader after {back:.2f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
