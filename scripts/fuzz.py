#!/usr/bin/env python3
"""Coverage-guided fuzzing of llmgw's outside-facing decoders with atheris (libFuzzer).

An optional, longer run beside the bounded hypothesis suite that CI runs (tests/fuzz,
``pytest -m fuzz``). atheris is not a dependency of llmgw::

    pip install atheris==3.0.0            # a manylinux wheel for CPython 3.11
    python scripts/fuzz.py --list
    python scripts/fuzz.py --seconds 60   # every target, one minute each
    python scripts/fuzz.py codec http --seconds 600 --corpus .fuzz-corpus

Each target runs in a process of its own (libFuzzer owns the process) for ``--seconds``,
with a corpus folder per target under ``--corpus`` that persists between runs. A crash
stops its target and leaves a ``crash-*`` file (the input) in that folder: rerun it with
``python scripts/fuzz.py TARGET --reproduce FILE``, fix it, and keep the input as a named
regression test in tests/fuzz. A target "crashes" on any exception its decoder does not
document, on a 500 from the gateway, and on a refusal that is not the client's fault.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

Target = Callable[[bytes], None]


def _codec() -> Target:
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError

    from llmgw.api.llmgw.v1 import AgentServiceBase, ControlServiceBase, RouterServiceBase
    from llmgw.server.wire.codec import decode_message

    services = (ControlServiceBase(), AgentServiceBase(), RouterServiceBase())
    types = sorted({h.request_type for s in services for h in s.__mapping__().values()}, key=str)

    def target(data: bytes) -> None:
        message_type = types[data[0] % len(types)] if data else types[0]
        try:
            message = decode_message(data[1:], message_type)
        except GRPCError as exc:
            if exc.status not in (Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED):
                raise
            return
        assert bytes(decode_message(bytes(message), message_type)) == bytes(message)

    return target


def _grpcweb() -> Target:
    from llmgw.api.llmgw.v1 import ControlServiceBase
    from llmgw.server.wire.grpcweb import GrpcWebApp

    app = GrpcWebApp([ControlServiceBase()], max_message_bytes=64 * 1024)
    loop = asyncio.new_event_loop()
    kinds = [b"application/grpc-web", b"application/grpc-web-text"]

    async def call(path: str, content_type: bytes, body: bytes) -> list[MutableMapping[str, Any]]:
        sent: list[MutableMapping[str, Any]] = []
        chunks = [body]

        async def receive() -> dict[str, object]:
            if chunks:
                return {"type": "http.request", "body": chunks.pop(), "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        headers = [(b"content-type", content_type)]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
        await app(scope, receive, send)
        return sent

    paths = sorted(ControlServiceBase().__mapping__())

    def target(data: bytes) -> None:
        path = paths[data[0] % len(paths)] if data else paths[0]
        kind = kinds[data[1] % 2] if len(data) > 1 else kinds[0]
        sent = loop.run_until_complete(call(path, kind, data[2:]))
        trailer = bytes(sent[-1]["body"])
        assert b"grpc-status:13" not in trailer and b"grpc-status:2\r" not in trailer, sent

    return target


def _kv_events() -> Target:
    from llmgw.kvcache import KvEventDecodeError, decode_batch, decode_frames
    from llmgw.kvcache.keys import pack_keys
    from llmgw.kvcache.mirror import BlockMirror

    mirror = BlockMirror()

    def target(data: bytes) -> None:
        try:
            decode_frames(data.split(b"\x00\x00\x00", 2))
        except KvEventDecodeError:
            pass
        try:
            batch = decode_batch(data)
        except KvEventDecodeError:
            return
        mirror.apply(batch)
        delta = mirror.take_delta()
        pack_keys(delta.stored + delta.stored_keys + delta.removed + delta.removed_keys)
        if len(mirror) > 100_000:
            mirror.reset()

    return target


def _profiles() -> Target:
    from llmgw.server.core.profiles import parse_document, render_document
    from llmgw.server.errors import ProfileError

    def target(data: bytes) -> None:
        try:
            document = parse_document(data.decode("utf-8", "replace"))
        except ProfileError as exc:
            assert exc.problems
            return
        assert parse_document(render_document(document)) == document

    return target


def _openai() -> Target:
    from llmgw.gateway.errors import BadRequest
    from llmgw.gateway.openai import CHAT_PATH, COMPLETIONS_PATH, parse_request

    def target(data: bytes) -> None:
        path = CHAT_PATH if data[:1] == b"c" else COMPLETIONS_PATH
        try:
            parse_request(path, data, {})
        except BadRequest:
            pass

    return target


def _tokenize() -> Target:
    from llmgw.gateway.tokenize import parse_tokens, tokenize_input

    def target(data: bytes) -> None:
        parse_tokens(data, 1 << 16)
        tokenize_input("/v1/chat/completions", data, "m")
        tokenize_input("/v1/completions", data, "m")

    return target


def _metrics() -> Target:
    from llmgw.agent.probe import parse_in_flight
    from llmgw.gateway.engines import ReuseWindow, parse_engine_metrics

    window = ReuseWindow(60.0)

    def target(data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        parse_in_flight(text)
        try:
            sample = parse_engine_metrics(text)
        except ValueError:
            return
        window.update(sample, 0.0)

    return target


def _http() -> Target:
    from llmgw.gateway.httpconnection import HttpConnection
    from llmgw.gateway.httplimits import ServerLimits
    from llmgw.gateway.httpserver import HttpServer

    loop = asyncio.new_event_loop()
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(data)

        def close(self) -> None: ...
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...

        def get_extra_info(self, name: str) -> None:
            return None

    async def handler(request: object, conn: HttpConnection) -> None:
        conn.respond(200, b"{}")

    async def make() -> HttpServer:
        return HttpServer(handler, ServerLimits(max_body_bytes=4096, max_head_bytes=8192))

    server = loop.run_until_complete(make())

    def target(data: bytes) -> None:
        written.clear()
        conn = HttpConnection(server)
        conn.connection_made(Transport())  # type: ignore[arg-type]
        conn.data_received(data)
        loop.run_until_complete(asyncio.sleep(0))
        conn.connection_lost(None)
        out = b"".join(written)
        assert b" 500 " not in out[:16], out[:200]

    return target


TARGETS: dict[str, Callable[[], Target]] = {
    "codec": _codec,
    "grpcweb": _grpcweb,
    "kv-events": _kv_events,
    "profiles": _profiles,
    "openai": _openai,
    "tokenize": _tokenize,
    "metrics": _metrics,
    "http": _http,
}


REPO = Path(__file__).resolve().parents[1]
_REQUESTS = [
    b'{"model": "m", "prompt": "The capital of France is", "max_tokens": 4}',
    b'{"model": "m", "prompt": [[1, 2, 3], [4]], "stream": true, "user": "u1"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false}',
]


def _seeds(name: str) -> list[bytes]:
    """Real inputs to start a target's corpus from: libFuzzer mutates them."""
    if name == "profiles":
        return [p.read_bytes() for p in sorted((REPO / "tests/data/profiles").glob("*.toml"))]
    if name == "metrics":
        return [(REPO / "tests/sim/vllm-0.32-metrics-sample.txt").read_bytes()]
    if name in ("openai", "tokenize"):
        return [*_REQUESTS, b'{"tokens": [1, 2, 3], "count": 3, "max_model_len": 8192}']
    if name == "http":
        return [b"POST /v1/completions HTTP/1.1\r\nhost: [::1]\r\ncontent-length: %d\r\n\r\n%s"
                % (len(r), r) for r in _REQUESTS]  # fmt: skip
    if name == "kv-events":
        import json

        golden = json.loads((REPO / "tests/data/vllm_kv_golden.json").read_text())
        return [bytes.fromhex(batch["frames_hex"][2])
                for case in golden["event_batch_cases"]
                for batch in case["expected"]["batches"]]  # fmt: skip
    return []


def _run(name: str, seconds: int, corpus: Path, reproduce: Path | None) -> None:
    """In this process: fuzz one target (libFuzzer exits the process when it is done)."""
    import atheris

    target = TARGETS[name]()
    atheris.instrument_all()
    folder = corpus / name
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.iterdir()):
        for i, seed in enumerate(_seeds(name)):
            (folder / f"seed-{i}").write_bytes(seed)
    args = [sys.argv[0], "-rss_limit_mb=2048", "-timeout=10", f"-artifact_prefix={folder}/"]
    args += [str(reproduce)] if reproduce else [f"-max_total_time={seconds}", str(folder)]
    atheris.Setup(args, target)
    atheris.Fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], metavar="TARGET",
                        help=f"targets to run (default: all): {', '.join(TARGETS)}")  # fmt: skip
    parser.add_argument("--seconds", type=int, default=60, help="per target (default 60)")
    parser.add_argument("--corpus", type=Path, default=Path(".fuzz-corpus"))
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument("--reproduce", type=Path, help="run one target on this input only")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.list:
        print("\n".join(TARGETS))
        return 0
    try:
        import atheris  # noqa: F401
    except ImportError:
        print("atheris is not installed: pip install atheris==3.0.0", file=sys.stderr)
        return 2
    names = args.targets or list(TARGETS)
    if args.in_process or args.reproduce:
        _run(names[0], args.seconds, args.corpus, args.reproduce)
        return 0
    failed = []
    for name in names:
        print(f"== {name}: {args.seconds} s, corpus {args.corpus / name}", flush=True)
        command = [sys.executable, __file__, name, "--in-process", "--seconds",
                   str(args.seconds), "--corpus", str(args.corpus)]  # fmt: skip
        if subprocess.run(command, check=False).returncode != 0:
            failed.append(name)
    print(f"targets that crashed: {', '.join(failed)}" if failed else "no crash", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
