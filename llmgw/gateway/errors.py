"""The gateway's exceptions.

::

    GatewayError                anything the gateway raises on purpose
    ├── RequestRefused          a request answered with an OpenAI-style error JSON; ``status``,
    │   │                       ``error_type`` and ``param`` are what the answer carries
    │   ├── BadRequest          400: a malformed body or header (the message names what)
    │   ├── PermissionDenied    403: a tenant key that may not use the request's model
    │   ├── ModelNotFound       404: no replica, in any state, serves this model
    │   ├── BodyTooLarge        413: the body is larger than ``max_body_bytes``
    │   ├── RateLimited         429 with Retry-After and x-ratelimit-*: over a key's limit
    │   ├── NoReplica           503: no READY replica could take the request
    │   │   └── HoldRefused     503 with Retry-After: held too long, or the queue was full
    │   └── GatewayTimeout      504: the request ran past ``request_timeout_s``
    └── UpstreamError           a replica could not be used for one request
        ├── UpstreamConnectError    no connection could be made (refused, timeout, no route)
        ├── UpstreamClosed          the connection closed or reset before the response ended
        ├── UpstreamRefused         the replica answered 502 or 503 (retried when another is left)
        └── UpstreamProtocolError   the replica's answer is not HTTP/1.1 we can read

``RequestRefused`` errors become responses in exactly one place (``gateway.py``);
``UpstreamError`` never reaches a client as such: before the first byte of the response the
request is retried on another replica, after it the client's connection is closed so that it
sees a truncated response. Foreign exceptions (``OSError``, httptools' parser errors) are
mapped to these where they are caught, ``raise … from exc``. Anything else escaping a
request handler is our bug: logged, answered 500.
"""

from __future__ import annotations


class GatewayError(Exception):
    """Base of the gateway's own exceptions."""


class RequestRefused(GatewayError):
    """A request answered with an OpenAI-style error JSON."""

    status = 500
    error_type = "InternalServerError"
    code: int | str | None = None  # the error JSON's ``code``; None: the status

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(RequestRefused):
    """400: a malformed body or header; the message names what was wrong."""

    status = 400
    error_type = "BadRequestError"


class PermissionDenied(RequestRefused):
    """403: a tenant key whose models do not include the request's (``tenants``)."""

    status = 403
    error_type = "PermissionDeniedError"


class ModelNotFound(RequestRefused):
    """404: no replica, in any state, serves this model (vLLM's answer for an unknown model)."""

    status = 404
    error_type = "NotFoundError"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model[:256]}` does not exist.", param="model")
        self.model = model


class BodyTooLarge(RequestRefused):
    """413: the request body is larger than the gateway accepts."""

    status = 413
    error_type = "RequestEntityTooLargeError"


class RateLimited(RequestRefused):
    """429: a tenant key over its requests, tokens or concurrency limit (``tenants``).

    ``retry_after_s`` (an integer ≥ 1) and ``headers`` (the ``x-ratelimit-*`` lines, each
    ending CRLF) go on the answer; its code is OpenAI's ``rate_limit_exceeded``."""

    status = 429
    error_type = "RateLimitError"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int, headers: bytes = b"") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = headers


class NoReplica(RequestRefused):
    """503: no READY replica could take the request (none, or every one tried failed)."""

    status = 503
    error_type = "ServiceUnavailableError"


class HoldRefused(NoReplica):
    """503 with ``Retry-After``: a request for a scalable model no replica was READY for,
    after the hold limit or because its queue was full (``llmgw.gateway.holding``)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class GatewayTimeout(RequestRefused):
    """504: the request ran past the gateway's request timeout before any answer."""

    status = 504
    error_type = "GatewayTimeoutError"


class UpstreamError(GatewayError):
    """A replica could not be used for one request."""


class UpstreamConnectError(UpstreamError):
    """No connection to the replica could be made (refused, timed out, unreachable)."""


class UpstreamClosed(UpstreamError):
    """The replica's connection closed or reset before its response ended."""


class UpstreamRefused(UpstreamError):
    """The replica answered 502 or 503: overloaded, or failing behind its own front."""


class UpstreamProtocolError(UpstreamError):
    """The replica's answer is not HTTP/1.1 the gateway can read (or its head is too large)."""


__all__ = [
    "BadRequest",
    "BodyTooLarge",
    "GatewayError",
    "GatewayTimeout",
    "HoldRefused",
    "ModelNotFound",
    "NoReplica",
    "PermissionDenied",
    "RateLimited",
    "RequestRefused",
    "UpstreamClosed",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamRefused",
]
