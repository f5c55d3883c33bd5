"""Running out of file descriptors, shared by every long-running process (server, gateway,
agent); imports nothing else of llmgw.

Every socket is a descriptor, and the usual soft limit (1024) is reached by a few hundred
idle connections: then ``accept()`` fails on every port. :func:`raise_open_files_limit`
lifts the soft ``RLIMIT_NOFILE`` to the hard limit at start (what vLLM, nginx and systemd
services do), so that only the hard limit an operator set stops a process.

When the limit is reached anyway, asyncio (and uvloop) report each failed ``accept()``
through the loop's exception handler, with a traceback, once a second per listener; a
process flooded with connections then writes megabytes of log a minute.
:func:`throttled_accept_errors` installs a handler that logs such errors (EMFILE, ENFILE,
ENOBUFS, ENOMEM from a listening socket) at most once per ``every_s`` seconds, in one line
with the count of those not logged since; every other error goes to the handler before it.
:func:`within_fd_limits` does both around a process's main coroutine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

_T = TypeVar("_T")

log = logging.getLogger(__name__)

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""The errors of ``accept()`` that say the process or system is out of a resource."""
ACCEPT_ERROR_EVERY_S = 10.0
"""At most one accept-error line per this many seconds, per process."""
_NR_OPEN = Path("/proc/sys/fs/nr_open")  # Linux: the most a hard limit may be

ExceptionHandler = Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object]


def raise_open_files_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard one (or the most the kernel allows when
    the hard one is unlimited); the soft limit now. Never lowers it, never raises."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_most()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, target, exc)
            return soft
        log.info("open files limit raised from %d to %d (the hard limit)", soft, target)
        return target
    return soft


def _kernel_most() -> int:
    try:
        return int(_NR_OPEN.read_text())
    except (OSError, ValueError):
        return 1 << 20


class AcceptErrorThrottle:
    """A loop exception handler: accept errors for want of resources at most once per
    ``every_s`` seconds (with how many were not logged), everything else passed on."""

    def __init__(
        self,
        passed_on: ExceptionHandler | None,
        every_s: float = ACCEPT_ERROR_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._passed_on = passed_on
        self._every_s = every_s
        self._clock = clock
        self._last: float | None = None
        self.suppressed = 0  # accept errors not logged since the last line

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and _accepting(context)):
            if self._passed_on is not None:
                self._passed_on(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = self._clock()
        if self._last is not None and now - self._last < self._every_s:
            self.suppressed += 1
            return
        if self._last is None:
            log.error(
                "cannot accept connections: %s (raise the open files limit or lower the "
                "connection caps; this is logged at most every %.0f s)",
                exc,
                self._every_s,
            )
        else:
            log.error(
                "cannot accept connections: %s (%d more times since %.0f s ago)",
                exc,
                self.suppressed,
                now - self._last,
            )
        self._last, self.suppressed = now, 0


def _accepting(context: dict[str, Any]) -> bool:
    """Whether the error is a listening socket's (asyncio: "socket.accept() out of system
    resource"; uvloop's libuv accepts and drops connections instead, and logs nothing)."""
    return "accept" in str(context.get("message", ""))


@contextlib.contextmanager
def throttled_accept_errors(every_s: float = ACCEPT_ERROR_EVERY_S) -> Iterator[AcceptErrorThrottle]:
    """Run the block with an :class:`AcceptErrorThrottle` on the running loop, passing other
    errors to its handler before; that handler is put back after."""
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    throttle = AcceptErrorThrottle(before, every_s)
    loop.set_exception_handler(throttle)
    try:
        yield throttle
    finally:
        loop.set_exception_handler(before)


async def within_fd_limits(work: Coroutine[Any, Any, _T]) -> _T:
    """Run a long-running process's main coroutine with the open files limit raised and
    accept errors throttled (``llmgw server``, ``llmgw agent`` and ``llmgw gateway``)."""
    raise_open_files_limit()
    with throttled_accept_errors():
        return await work
