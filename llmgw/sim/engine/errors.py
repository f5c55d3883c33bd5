"""The simulated engine's exceptions.

::

    SimEngineError              anything the simulated engine raises on purpose
    ├── SimConfigError          a flag or its value is malformed (the message names the flag)
    ├── SimStartError           the engine cannot start: a port or socket that cannot be
    │                           bound, or ``--sim-fail-start``
    └── RequestError            one HTTP request is refused; carries the status, the OpenAI
                                error type and the offending parameter, as vLLM answers

``RequestError`` never leaves the HTTP layer: the app turns it into vLLM's error JSON in one
place. Foreign exceptions (``json.JSONDecodeError``, ``zmq.ZMQError``, ``OSError`` from a
bind) are mapped to these where they occur, ``raise … from exc``. Anything else escaping a
handler is our bug and answers 500.
"""

from __future__ import annotations

from http import HTTPStatus


class SimEngineError(Exception):
    """Base of the simulated engine's own exceptions."""


class SimConfigError(SimEngineError, ValueError):
    """A flag or its value is malformed; the message names the flag."""


class SimStartError(SimEngineError):
    """The engine cannot start (a bind failed, or ``--sim-fail-start`` asked for it)."""


class RequestError(SimEngineError):
    """An HTTP request vLLM would refuse, with what vLLM answers."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        """vLLM's error type: the HTTP phrase as a class name (``NotFoundError``)."""
        return _ERROR_TYPES.get(self.status, "InternalServerError")


_ERROR_TYPES: dict[int, str] = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.UNPROCESSABLE_ENTITY: "UnprocessableEntityError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}
