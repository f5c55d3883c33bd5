"""A small stand-in engine for the supervisor's tests (a script, not a test module).

It serves ``/health`` (503 while "loading"), ``/v1/models`` (401 without the API key),
``/metrics`` (``vllm:num_requests_running``: the ``/slow`` requests in flight) and
``/slow?seconds=S``. Behaviour flags::

    --port P --api-key K        where it listens, the key /v1/models wants
    --load-seconds S            bind at once, answer /health 503 for S seconds (llama.cpp)
    --bind-after S              do not bind for S seconds (vLLM binds only when ready)
    --exit-after S --exit-code N    exit by itself after S seconds
    --ignore-sigterm            ignore SIGTERM (the supervisor must SIGKILL the group)
    --child                     start a child process (same group) that ignores SIGTERM
    --starts FILE               append this process's pid to FILE when it starts

It prints its pid, the environment variables the tests check and its child's pid.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

_lock = threading.Lock()
_in_flight = 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--api-key", default="")
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--bind-after", type=float, default=0.0)
    parser.add_argument("--exit-after", type=float, default=0.0)
    parser.add_argument("--exit-code", type=int, default=1)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--starts", default="")
    args = parser.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.starts:
        with open(args.starts, "a") as file:
            file.write(f"{os.getpid()}\n")
    say(f"fake engine pid {os.getpid()}")
    for name in ("CUDA_VISIBLE_DEVICES", "VLLM_TEST_ENV"):
        say(f"env {name}={os.environ.get(name, '<unset>')}")
    if args.child:
        child = subprocess.Popen([sys.executable, "-c", _CHILD], start_new_session=False)
        say(f"child pid {child.pid}")
    if args.exit_after:
        threading.Thread(target=_exit_later, args=(args.exit_after, args.exit_code)).start()
    time.sleep(args.bind_after)
    serve(args)


_CHILD = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n"


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _exit_later(seconds: float, code: int) -> None:
    time.sleep(seconds)
    say(f"fake engine exiting with {code}")
    os._exit(code)


def serve(args: argparse.Namespace) -> None:
    ready_at = time.monotonic() + args.load_seconds

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/health":
                self._reply(200 if time.monotonic() >= ready_at else 503, {})
            elif url.path == "/v1/models":
                if args.api_key and self.headers.get("Authorization") != f"Bearer {args.api_key}":
                    self._reply(401, {"error": "bad key"})
                else:
                    self._reply(200, {"object": "list", "data": [{"id": "fake"}]})
            elif url.path == "/metrics":
                text = f'vllm:num_requests_running{{engine="0",model_name="fake"}} {_in_flight}.0\n'
                self._reply(200, text)
            elif url.path == "/slow":
                self._slow(float(parse_qs(url.query).get("seconds", ["1"])[0]))
            else:
                self._reply(404, {})

        def _slow(self, seconds: float) -> None:
            global _in_flight
            with _lock:
                _in_flight += 1
            try:
                time.sleep(seconds)
                self._reply(200, {"slept": seconds})
            finally:
                with _lock:
                    _in_flight -= 1

        def _reply(self, code: int, body: object) -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    ThreadingHTTPServer.daemon_threads = True
    with ThreadingHTTPServer(("127.0.0.1", args.port), Handler) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()
