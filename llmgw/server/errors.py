"""The control server's exceptions.

::

    ServerError                 anything the control server raises on purpose
    ├── StoreError              the state database cannot be opened, read or written
    │   └── StoreUnwritable     it cannot be written now (disk full, read-only, I/O
    │                           error, PostgreSQL unreachable): mutating RPCs answer
    │                           UNAVAILABLE (storehealth.py)
    ├── ConfigError             a flag or setting is malformed (the message names it)
    ├── UnknownNode             an operator named a node that was never seen
    ├── ActionRefused           an operator action that cannot be done; ``status`` is the
    │                           gRPC status to answer with, ``why`` says why in words
    ├── ProfileError            a profiles/deployments document is refused; ``problems``
    │                           names each fault by its key path (``profiles.x.tp: …``)
    ├── KvDeltaRefused          an agent's KvDelta is malformed (kvblocks.py)
    └── ReportRefused           a gateway's RouterReport is not taken; ``status`` and
                                ``why`` (routerreports.py)

Remote failures reach clients as gRPC statuses (``grpclib.exceptions.GRPCError``): the
services map these exceptions to statuses in one place each, ``raise … from exc``.
Anything else escaping a handler is our bug and answers INTERNAL.
"""

from __future__ import annotations

from grpclib.const import Status

QUOTE_LIMIT = 64
"""The most characters of a client's value that an error message repeats."""


def quoted(value: str, limit: int = QUOTE_LIMIT) -> str:
    """``value`` quoted for an error message, cut to ``limit`` characters.

    A client's value goes back in ``grpc-message``; repeating a huge one whole makes a
    trailer clients refuse (grpcio's limit is 16 KiB) and costs the server's one event loop
    time that grows with the square of its length in HPACK's Huffman coder.
    """
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


class ServerError(Exception):
    """Base of the control server's own exceptions."""


class StoreError(ServerError):
    """The state database cannot be opened, read or written."""


class Deposed(StoreError):
    """A write of a server that no longer holds the leader lease at its epoch: refused in
    the write's own transaction (``llmgw.server.state.lease``); nothing was written."""


class StoreUnwritable(StoreError):
    """The state database cannot be written now (full, read-only, an I/O error, or a
    PostgreSQL server that cannot be reached); the message is ``state database
    full/read-only: <the driver's message>`` or ``state database unreachable: <…>``.

    ``sticky``: every later write is refused without trying until the server restarts (an
    SQLite I/O error: ``llmgw.server.state.storehealth``)."""

    def __init__(self, message: str, *, sticky: bool = False) -> None:
        super().__init__(message)
        self.sticky = sticky


class ConfigError(ServerError):
    """A flag or setting is malformed; the message names it."""


class UnknownNode(ServerError):
    """An operator named a node that was never seen."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"no node named {quoted(node_id)} has ever registered")
        self.node_id = node_id


class ProfileError(ServerError):
    """A profiles/deployments document is refused whole, with every problem it has.

    ``problems`` holds one line per fault, each starting with its key path; ``str()`` lists
    them one per line, each prefixed by ``source`` (the file name, usually).
    """

    def __init__(self, problems: tuple[str, ...], *, source: str = "<input>") -> None:
        super().__init__("\n".join(f"{source}: {problem}" for problem in problems))
        self.problems = problems
        self.source = source


class ActionRefused(ServerError):
    """An operator action that cannot be done: the gRPC status and why, in words."""

    def __init__(self, status: Status, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why
