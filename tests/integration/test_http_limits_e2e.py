"""Resource limits of the two HTTP ports (gRPC-web and the in-server gateway), attacked from
outside: raw sockets against a real ``llmgw server`` process, each attack bounded in count
and time.

A slowloris head and a silent connection are closed after their timeouts; a 1 MB header is
431 and leaves the server's RSS where it was; connections over the per-peer cap are refused
at once while another peer (127.0.0.2) is served; bodies beyond the buffer budget are
refused unread; a body that trickles in is cut after its grace; keyless 32 MiB POSTs to the
gateway are 401 before their body is read.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from procs import Cluster

from llmgw.gateway.httplimits import ServerLimits

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HEADER_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 2.0
PER_PEER = 8
BODY_BUFFER = 8 << 20
LIMIT_FLAGS = (
    "--header-timeout",
    str(HEADER_TIMEOUT_S),
    "--idle-timeout",
    str(IDLE_TIMEOUT_S),
    "--max-connections-per-peer",
    str(PER_PEER),
    "--max-body-buffer",
    str(BODY_BUFFER),
)
SWEEP_SLACK_S = 3.0  # the server sweeps once a second; a loaded machine is late
GRPC_WEB_CALL = b"/llmgw.v1.ControlService/GetCluster"
KEY = "sk-limits-test-key"


@pytest.fixture
def limited(cluster: Cluster) -> Iterator[Cluster]:
    cluster.start_server(*LIMIT_FLAGS)
    yield cluster


def ports(cluster: Cluster) -> dict[str, int]:
    return {"grpc-web": cluster.http_port, "gateway": cluster.gateway_port}


def on_both(cluster: Cluster, attack: Callable[[int], object]) -> None:
    """Run ``attack`` on both HTTP ports at once (it raises AssertionError if one holds)."""
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(attack, port) for port in ports(cluster).values()]:
            future.result()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def until_closed(sock: socket.socket, within_s: float) -> bytes:
    """What the server sends before it closes; AssertionError if it is still open."""
    received = bytearray()
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return bytes(received)
        if not data:
            return bytes(received)
        received += data
    raise AssertionError(f"the server kept the connection open {within_s:.1f} s: {received!r}")


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer.split(b" ", 2)[1])


def request(port: int, head: bytes, source: str = "127.0.0.1") -> int:
    """The status of one request sent whole on a fresh connection (closed after)."""
    with connect(port, source) as sock:
        sock.sendall(head)
        answer = bytearray()
        while b"\r\n" not in answer:
            data = sock.recv(4096)
            assert data, f"closed without an answer to {head[:80]!r}"
            answer += data
        return status_of(bytes(answer))


def get_healthz(port: int, source: str = "127.0.0.1") -> int:
    return request(
        port, b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n", source
    )


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_slowloris_head_is_cut_at_the_header_timeout(limited: Cluster) -> None:
    def attack(port: int) -> None:
        with connect(port) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\nx-slow: ")
            started, sent = time.monotonic(), 0
            sock.settimeout(1.0)
            while time.monotonic() - started < HEADER_TIMEOUT_S + SWEEP_SLACK_S:
                try:
                    sock.sendall(b"a")  # one header byte a second
                    sent += 1
                    if (data := sock.recv(4096)) == b"":
                        return  # closed
                    assert status_of(data) == 408
                    until_closed(sock, 2.0)
                    return
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    return
            raise AssertionError(f"a head of one byte a second was kept open ({sent} bytes)")

    on_both(limited, attack)
    assert get_healthz(limited.http_port) == 200


def test_a_body_a_byte_a_second_is_cut_after_its_grace(limited: Cluster) -> None:
    grace = ServerLimits().body_timeout_s  # then min_body_rate (32 KiB/s) must hold

    def attack(port: int) -> None:
        with connect(port) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n"
                b"content-type: application/grpc-web+proto\r\ncontent-length: 100000\r\n\r\n"
            )
            started = time.monotonic()
            sock.settimeout(1.0)
            while time.monotonic() - started < grace + SWEEP_SLACK_S:
                try:
                    sock.sendall(b"a")
                    if (data := sock.recv(4096)) == b"":
                        return
                    assert status_of(data) == 408
                    return
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    return
            raise AssertionError("a body of one byte a second was kept open")

    on_both(limited, attack)


def test_a_silent_connection_is_closed_after_the_idle_timeout(limited: Cluster) -> None:
    def attack(port: int) -> None:
        with connect(port) as sock:
            assert until_closed(sock, IDLE_TIMEOUT_S + SWEEP_SLACK_S) == b""

    on_both(limited, attack)


def test_a_1mb_header_is_431_and_the_server_does_not_grow(limited: Cluster) -> None:
    pid = limited.procs["server"].pid
    before = rss_kib(pid)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\nx-big: "
        + b"a" * (1 << 20)
        + b"\r\n\r\n"
    )

    def attack(port: int) -> None:
        for _ in range(10):
            with connect(port) as sock:
                try:
                    sock.sendall(head)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused before all of it was sent: the answer is waiting
                assert status_of(until_closed(sock, 5.0)) == 431

    on_both(limited, attack)
    grown = rss_kib(pid) - before
    assert grown < 16 * 1024, f"the server grew by {grown} KiB"
    assert get_healthz(limited.gateway_port) == 200


def test_connections_over_the_per_peer_cap_are_refused_while_another_peer_works(
    limited: Cluster,
) -> None:
    def attack(port: int) -> None:
        held = [connect(port) for _ in range(PER_PEER)]
        try:
            time.sleep(0.2)  # all of them accepted
            with connect(port) as extra:
                answer = until_closed(extra, 2.0)  # at once, nothing of it read
                assert status_of(answer) == 503
                assert b"the limit per client" in answer
            assert get_healthz(port, source="127.0.0.2") == 200  # another peer is served
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.2)  # their closes reached the server
        assert get_healthz(port) == 200

    on_both(limited, attack)


def test_bodies_beyond_the_buffer_budget_are_refused_unread(limited: Cluster) -> None:
    four_mib = 4 << 20

    def head(port: int, length: int) -> bytes:
        path = GRPC_WEB_CALL if port == limited.http_port else b"/v1/completions"
        return (
            b"POST %s HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/grpc-web+proto\r\n"
            b"content-length: %d\r\n\r\n" % (path, length)
        )

    def attack(port: int) -> None:
        holders = [connect(port) for _ in range(BODY_BUFFER // four_mib)]
        try:
            for sock in holders:  # each takes 4 MiB of the budget; their bodies never come
                sock.sendall(head(port, four_mib) + b"x" * 1024)
            time.sleep(0.3)
            with connect(port) as sock:
                sock.sendall(head(port, four_mib))
                answer = until_closed(sock, 2.0)
                assert status_of(answer) == 503
                assert b"request bodies" in answer
            assert request(port, head(port, 5) + b"\x00\x00\x00\x00\x00") == 503
        finally:
            for sock in holders:
                sock.close()
        time.sleep(0.3)  # the budget is given back with the connections
        assert request(port, head(port, 5) + b"\x00\x00\x00\x00\x00") != 503

    on_both(limited, attack)


def test_keyless_32mib_posts_to_the_gateway_are_401_before_the_body(
    cluster: Cluster, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    cluster.start_server("--gateway-api-key-file", str(keys))
    pid = cluster.procs["server"].pid
    before = rss_kib(pid)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (32 << 20)
    )
    socks = [connect(cluster.gateway_port) for _ in range(40)]
    try:
        for sock in socks:
            sock.sendall(head)  # the head alone: the answer must not wait for the body
        for sock in socks:
            answer = until_closed(sock, 5.0)
            assert status_of(answer) == 401
    finally:
        for sock in socks:
            sock.close()
    grown = rss_kib(pid) - before
    assert grown < 16 * 1024, f"the server grew by {grown} KiB"
    authorized = head.replace(
        b"host: localhost\r\n", f"host: localhost\r\nauthorization: Bearer {KEY}\r\n".encode()
    )
    with connect(cluster.gateway_port) as sock:  # a keyed one is taken in: no answer yet
        sock.sendall(authorized)
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(1)
