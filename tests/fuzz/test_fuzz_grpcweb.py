"""Fuzzing the gRPC-web port (``llmgw.server.wire.grpcweb.GrpcWebApp``) as an ASGI application in
front of the real ControlService: any method, path, headers, content type and body, in
binary and text modes, cut into any chunks.

What must hold: exactly one response, well formed: a plain HTTP status the bridge documents
(204 preflight, 200 health, 405, 415) or a 200 whose body is data frames then one trailer
frame (base64 in text mode) with a status that is the client's fault or the handler's
answer, never INTERNAL or UNKNOWN; the app serves the next request as before; 1,000
malformed requests leave no memory behind.
"""

from __future__ import annotations

import asyncio
import base64
import random
import re
import time
from collections.abc import AsyncIterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from fuzzkit import async_growth, examples, mutated, wire_message
from grpclib.const import Status
from hypothesis import event, example, given
from hypothesis import strategies as st

from llmgw.api.llmgw.v1 import ControlServiceBase, GetClusterRequest
from llmgw.server.state.plane import ControlPlane
from llmgw.server.state.store import Store
from llmgw.server.wire.controlsvc import ControlService
from llmgw.server.wire.grpcweb import GrpcWebApp

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]

LIMIT = 64 * 1024
HANDLERS = ControlServiceBase().__mapping__()
PATHS = sorted(HANDLERS)
WATCH = "/llmgw.v1.ControlService/Watch"
GET_CLUSTER = "/llmgw.v1.ControlService/GetCluster"
BINARY_TYPES = ["application/grpc-web", "application/grpc-web+proto"]
TEXT_TYPES = ["application/grpc-web-text", "application/grpc-web-text+proto"]
CLIENT_FAULTS = {
    Status.OK, Status.INVALID_ARGUMENT, Status.RESOURCE_EXHAUSTED, Status.UNIMPLEMENTED,
    Status.DEADLINE_EXCEEDED, Status.NOT_FOUND, Status.FAILED_PRECONDITION,
    Status.ALREADY_EXISTS, Status.PERMISSION_DENIED, Status.UNAUTHENTICATED,
}  # fmt: skip


def frame(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


# --- what a client sends -----------------------------------------------------------------


@dataclass
class Call:
    method: str
    path: str
    headers: list[tuple[bytes, bytes]]
    chunks: list[bytes]
    text: bool = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


_payloads = st.sampled_from(PATHS).flatmap(
    lambda p: wire_message(HANDLERS[p].request_type) | st.binary(max_size=64)
)
_framed = st.one_of(
    _payloads.map(frame),
    mutated(_payloads.map(frame)),
    st.tuples(st.sampled_from([0x00, 0x01, 0x80, 0x81, 0x7F]), _payloads).map(
        lambda fp: frame(fp[1], fp[0])
    ),
    st.lists(_payloads.map(frame), min_size=2, max_size=3).map(b"".join),
    st.binary(max_size=40),
    st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=16)).map(
        lambda lp: b"\x00" + lp[0].to_bytes(4, "big") + lp[1]
    ),
)


@st.composite
def _text_body(draw: st.DrawFn) -> bytes:
    """grpc-web-text: base64 of frames, in padded chunks, with whitespace; or not base64."""
    odd = draw(st.integers(0, 7))
    if odd == 0:
        return draw(st.binary(max_size=40))
    if odd == 1:  # long base64 runs, then a byte that is not base64 (see the regression)
        run = draw(st.integers(20, 5000)) * draw(st.sampled_from([b"A", b"QQ", b"A=", b"AA=="]))
        return run + draw(st.sampled_from([b"!", b"\x01", b"===", b"-", b"A\xff"]))
    data = draw(_framed)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    encoded = [base64.b64encode(p) for p in pieces]
    if draw(st.booleans()):
        encoded = [e.rstrip(b"=") for e in encoded]
    glue = draw(st.sampled_from([b"", b"\r\n", b" ", b"=", b"\t"]))
    return glue.join(encoded)


_header_values = st.binary(max_size=24) | st.sampled_from(
    [b"1S", b"100m", b"99999999H", b"-1S", b"1", b"S", b"1.5S", b"0n", b"00000001u"]
)
_extra_headers = st.lists(
    st.tuples(
        st.sampled_from(
            [b"grpc-timeout", b"x-grpc-web", b"origin", b"x-user-agent", b"user-agent",
             b"authorization", b"te", b"trace-bin", b"x-key-bin", b"content-length",
             b"grpc-encoding", b"accept"]
        )
        | st.binary(min_size=1, max_size=12).map(bytes.lower),
        _header_values | st.binary(max_size=12).map(base64.b64encode),
    ),
    max_size=4,
)  # fmt: skip


@st.composite
def calls(draw: st.DrawFn) -> Call:
    odd = draw(st.integers(0, 9)) == 0  # one call in ten is odd at the HTTP level
    method = draw(st.sampled_from(["GET", "OPTIONS", "PUT", "PRI", "post"])) if odd else "POST"
    path = draw(st.sampled_from(PATHS))
    if draw(st.integers(0, 9)) == 0:
        path = draw(st.sampled_from(["/healthz", "/", "/llmgw.v1.X/Y", ""]) | st.text(max_size=20))
    text = draw(st.booleans())
    content_type = draw(
        st.sampled_from(TEXT_TYPES if text else BINARY_TYPES).flatmap(
            lambda ct: st.sampled_from([ct] * 4 + [ct.upper(), ct + "; charset=utf-8", " " + ct])
        )
    )
    if draw(st.integers(0, 9)) == 0:
        content_type = draw(st.binary(max_size=30)).decode("latin-1")
    headers = [(b"content-type", content_type.encode("latin-1")), *draw(_extra_headers)]
    body = draw(_text_body()) if text else draw(_framed)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    return Call(method, path, headers, chunks, text)


# --- running one ---------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    ended: bool
    messages: list[dict[str, Any]] = field(default_factory=list)


async def serve(app: GrpcWebApp, call: Call, *, patience_s: float = 5.0) -> Response | None:
    """Run one request through the app; None when it answered nothing before the client
    (after ``patience_s``: a Watch streams until its client goes) went away."""
    chunks = list(call.chunks) or [b""]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if chunks:
            body = chunks.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(chunks)}
        await asyncio.sleep(patience_s)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http",
        "method": call.method,
        "path": call.path,
        "headers": [(b"host", b"127.0.0.1:8080"), *call.headers],  # as HTTP/1.1 clients send
        "client": ("127.0.0.1", 40000),
    }
    async with asyncio.timeout(patience_s + 5):
        await app(scope, receive, send)
    if not sent:
        return None
    start, bodies = sent[0], sent[1:]
    assert start["type"] == "http.response.start", sent
    assert all(m["type"] == "http.response.body" for m in bodies), sent
    assert all(m.get("more_body", False) for m in bodies[:-1]), "a body after the last"
    ended = bool(bodies) and not bodies[-1].get("more_body", False)
    body = b"".join(m.get("body", b"") for m in bodies)
    return Response(start["status"], list(start["headers"]), body, ended, sent)


def frames_of(response: Response, text: bool) -> list[tuple[int, bytes]]:
    """The whole frames of a gRPC-web answer (base64 chunks decoded in text mode)."""
    body = response.body
    if text:
        body = b"".join(base64.b64decode(c) for c in re.findall(rb"[A-Za-z0-9+/]+={0,2}", body))
    frames = []
    while body:
        assert len(body) >= 5, body
        length = int.from_bytes(body[1:5], "big")
        assert len(body) >= 5 + length
        frames.append((body[0], body[5 : 5 + length]))
        body = body[5 + length :]
    return frames


def grpc_trailer(response: Response, text: bool) -> dict[str, str]:
    """Check the frames of a gRPC-web answer; its trailer."""
    frames = frames_of(response, text)
    assert frames and frames[-1][0] == 0x80, frames
    assert all(flag == 0 for flag, _ in frames[:-1]), frames
    lines = frames[-1][1].decode("ascii").split("\r\n")
    return {k: unquote(v) for k, _, v in (line.partition(":") for line in lines if line)}


def check(call: Call, response: Response | None) -> Status | int | str | None:
    """The answer's gRPC status, or its HTTP status when it is plain HTTP."""
    return check_message(call, response)[0]


def check_message(call: Call, response: Response | None) -> tuple[Status | int | str | None, str]:
    """`check`, with the answer's grpc-message ("" for none or plain HTTP)."""
    if response is None:
        assert call.path == WATCH and call.method == "POST", call
        return None, ""
    if not response.ended:  # a Watch streams until its client goes: data frames only
        assert call.path == WATCH and response.status == 200, response.messages
        assert all(flag == 0 for flag, _ in frames_of(response, call.text))
        return "streamed", ""
    content_type = dict(response.headers).get(b"content-type", b"").decode("latin-1")
    if not content_type.startswith("application/grpc-web"):
        assert response.status in (200, 204, 400, 403, 405, 415, 503), response
        return response.status, ""
    assert response.status == 200
    trailer = grpc_trailer(response, text="text" in content_type)
    status = Status(int(trailer["grpc-status"]))
    assert status in CLIENT_FAULTS, (call, trailer)
    message = trailer.get("grpc-message", "")
    assert len(message) < 4096
    return status, message


@dataclass
class Web:
    app: GrpcWebApp
    plane: ControlPlane


@pytest.fixture
async def web(tmp_path: Path) -> AsyncIterator[Web]:
    async with Store(tmp_path / "s.db") as store:
        plane = ControlPlane(store)
        await plane.load()
        yield Web(GrpcWebApp([ControlService(plane)], max_message_bytes=LIMIT), plane)


async def still_serves(app: GrpcWebApp) -> None:
    call = Call("POST", GET_CLUSTER, [(b"content-type", b"application/grpc-web")],
                [frame(bytes(GetClusterRequest()))])  # fmt: skip
    assert check(call, await serve(app, call)) is Status.OK


# --- the properties ----------------------------------------------------------------------


async def _answer(web: Web, call: Call) -> None:
    response = await serve(web.app, call, patience_s=0.5 if call.path == WATCH else 5.0)
    event(f"answer: {check(call, response)!s}")  # --hypothesis-show-statistics
    await still_serves(web.app)


@examples(250, shared_fixture=True)
@given(calls())
@example(Call("POST", GET_CLUSTER, [(b"content-type", b"application/grpc-web-text")],
              [b"AAAAAAA", b"=", b"AAAAAAA="], text=True))  # fmt: skip
@example(Call("POST", GET_CLUSTER, [(b"content-type", b"application/grpc-web")],
              [b"\x00\xff\xff\xff\xff"]))  # fmt: skip
@example(Call("POST", GET_CLUSTER, [(b"content-type", b"application/grpc-web"),
                                    (b"x-key-bin", b"!!!")], [frame(b"")]))  # fmt: skip
async def test_any_request_gets_one_well_formed_answer_and_the_app_keeps_serving(
    web: Web, call: Call
) -> None:
    await _answer(web, call)


@examples(100, shared_fixture=True)
@given(st.sampled_from(sorted(set(PATHS) - {WATCH})).flatmap(
    lambda p: st.tuples(st.just(p), wire_message(HANDLERS[p].request_type))
), st.booleans())  # fmt: skip
async def test_well_formed_nonsense_reaches_the_handlers_and_gets_their_answer(
    web: Web, rpc: tuple[str, bytes], text: bool
) -> None:
    """Every frame decodes: what comes back is the real handler's own status."""
    path, payload = rpc
    body = base64.b64encode(frame(payload)) if text else frame(payload)
    content_type = (TEXT_TYPES if text else BINARY_TYPES)[0].encode()
    call = Call("POST", path, [(b"content-type", content_type)], [body], text)
    status, message = check_message(call, await serve(web.app, call))
    assert isinstance(status, Status), status
    assert not message.startswith("cannot decode"), (call, message)
    assert status is not Status.RESOURCE_EXHAUSTED, (call, message)


@pytest.mark.parametrize(
    "run",
    [b"A" * 60_000, b"AA==" * 15_000, b"A" * 8 + b"A/+9" * 15_000],
    ids=["A", "AA==", "A/+9"],
)
async def test_regression_a_long_base64_run_then_a_bad_byte_is_refused_at_once(
    web: Web, run: bytes
) -> None:
    """Found by scripts/fuzz.py (atheris): the text body check ``(?:[A-Za-z0-9+/]+={0,2})*``
    backtracked exponentially, so 40 "A"s and a "!" held the event loop for hours."""
    call = Call("POST", GET_CLUSTER, [(b"content-type", b"application/grpc-web-text")],
                [run + b"\x01"], text=True)  # fmt: skip
    started = time.perf_counter()
    status, message = check_message(call, await serve(web.app, call))
    assert (status, message) == (Status.INVALID_ARGUMENT, "request body is not valid base64")
    assert time.perf_counter() - started < 1.0


async def test_a_thousand_malformed_requests_leave_no_memory_behind(web: Web) -> None:
    rng = random.Random(8)
    malformed = [
        Call("POST", rng.choice(PATHS), [(b"content-type", rng.choice(BINARY_TYPES).encode())],
             [frame(b"\x00" + rng.randbytes(rng.randrange(40)))])  # field number 0
        for _ in range(1000)
    ]  # fmt: skip

    async def send_all() -> None:
        for call in malformed:
            assert check(call, await serve(web.app, call)) is Status.INVALID_ARGUMENT

    assert await async_growth(send_all) < 64 * 1024
    await still_serves(web.app)
