"""``python -m llmgw sim-engine`` as a real process: loading, signals, faults, disconnects."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from simhelpers import metric, parse_metrics

from llmgw.addresses import free_port

pytestmark = pytest.mark.integration


class Engine:
    """One sim-engine process on a free loopback port, its log in a file."""

    def __init__(self, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.log_path = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "sim-engine", "serve", "sim-model",
                 "--port", str(self.port), "--disable-uvicorn-access-log", *flags],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def refused(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) != 0

    def wait(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    started: list[Engine] = []

    def start(*flags: str) -> Engine:
        engine = Engine(tmp_path / f"engine{len(started)}.log", *flags)
        started.append(engine)
        return engine

    try:
        yield start
    finally:
        for engine in started:
            engine.stop()


def test_the_port_refuses_connections_while_loading_then_serves_and_sigterm_exits_0(
    engines: Callable[..., Engine],
) -> None:
    engine = engines("--sim-load-seconds", "3")
    time.sleep(1.0)
    assert engine.proc.poll() is None and engine.refused()
    wait_for(engine.healthy, 30, "the engine to load")
    response = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert response.json()["usage"]["completion_tokens"] == 2
    started = time.monotonic()
    engine.proc.send_signal(signal.SIGTERM)
    assert engine.wait() == 0 and time.monotonic() - started < 5
    assert "Loading model sim-model" in engine.log()


def test_sigint_during_the_load_exits_0_promptly(engines: Callable[..., Engine]) -> None:
    engine = engines("--sim-load-seconds", "60")
    wait_for(lambda: "Loading model" in engine.log(), 20, "the load to start")
    engine.proc.send_signal(signal.SIGINT)
    assert engine.wait(timeout=5) == 0


def test_crash_after_n_requests_exits_1_with_a_log_line(engines: Callable[..., Engine]) -> None:
    engine = engines("--sim-crash-after", "2", "--sim-decode-ms-per-token", "0")
    wait_for(engine.healthy, 30, "the engine")
    for _ in range(2):
        body = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert body.status_code == 200
    assert engine.wait() == 1
    assert "simulated engine crash after 2 requests (--sim-crash-after)" in engine.log()


def test_fail_start_exits_non_zero_saying_why(engines: Callable[..., Engine]) -> None:
    engine = engines("--sim-fail-start", "--sim-load-seconds", "0.2")
    assert engine.wait() == 1
    assert "simulated start failure (--sim-fail-start)" in engine.log()
    assert "Traceback" not in engine.log()


def test_an_unknown_flag_exits_2(engines: Callable[..., Engine]) -> None:
    engine = engines("--no-such-flag")
    assert engine.wait() == 2
    assert "unrecognized arguments: --no-such-flag" in engine.log()


def test_a_taken_port_is_a_clear_start_error(engines: Callable[..., Engine]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        engine = engines("--port", port)
        assert engine.wait() == 1
    assert f"cannot listen on 127.0.0.1:{port}" in engine.log()


def test_a_headless_rank_binds_nothing_and_stops_on_sigterm(
    engines: Callable[..., Engine],
) -> None:
    engine = engines("--nnodes", "2", "--node-rank", "1", "--headless")
    wait_for(lambda: "Headless node 1 of 2" in engine.log(), 20, "the headless rank")
    assert engine.refused()
    engine.proc.send_signal(signal.SIGTERM)
    assert engine.wait() == 0


def test_a_client_that_leaves_mid_stream_frees_its_request(engines: Callable[..., Engine]) -> None:
    engine = engines("--sim-decode-ms-per-token", "20")
    wait_for(engine.healthy, 30, "the engine")
    body = {"prompt": "tell me", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", f"{engine.url}/v1/completions", json=body) as response,
    ):
        chunks = response.iter_lines()
        assert next(chunks).startswith("data: {")
        running = metric(
            parse_metrics(httpx.get(f"{engine.url}/metrics").text), "vllm:num_requests_running"
        )
        assert running == 1
    # Leaving the with-block closed the connection after one chunk of 500.

    def aborted() -> bool:
        samples = parse_metrics(httpx.get(f"{engine.url}/metrics").text)
        return (
            metric(samples, "vllm:num_requests_running") == 0
            and metric(samples, "vllm:request_success_total", finished_reason="abort") == 1
        )

    wait_for(aborted, 5, "the request to be aborted")
    samples = parse_metrics(httpx.get(f"{engine.url}/metrics").text)
    assert metric(samples, "vllm:generation_tokens_total") < 100
    assert metric(samples, "vllm:kv_cache_usage_perc") == 0


def test_a_client_that_gives_up_on_a_whole_answer_aborts_it(
    engines: Callable[..., Engine],
) -> None:
    engine = engines("--sim-decode-ms-per-token", "20")
    wait_for(engine.healthy, 30, "the engine")
    body = {"prompt": "tell me", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/v1/completions", json=body, timeout=0.5)

    def aborted() -> bool:
        samples = parse_metrics(httpx.get(f"{engine.url}/metrics").text)
        return metric(samples, "vllm:request_success_total", finished_reason="abort") == 1

    wait_for(aborted, 5, "the request to be aborted")
    assert "Exception in ASGI application" not in engine.log()
    assert "Traceback" not in engine.log()
