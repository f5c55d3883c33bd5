"""Errors of the agent's engine supervision, as one tree.

::

    SupervisorError            base of everything below; never escapes a command handler
    ├── ShardTransitionError   a shard state change the lifecycle table forbids (our bug)
    ├── SpawnError             an engine's process could not be started (exec failed)
    ├── EngineFailed           a started engine failed: it exited, timed out or stopped
    │                          answering its probe (carries the reason and the exit code)
    ├── RecordError            an adoption record on disk is unreadable or malformed
    └── SocketFolderError      an engine's KV event socket folder is not the agent's alone
                               (owner, mode, symlink: `llmgw.agent.ipcdir`)

``llmgw.agent.engines.EngineError`` (a ``ValueError``) belongs to the engine adapters: a
profile that cannot be turned into a command line. The supervisor reports it as FAILED
with its message, like every error above except ``ShardTransitionError``, which is a bug
and is logged with its traceback.
"""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of the supervisor's errors."""


class ShardTransitionError(SupervisorError):
    """A shard was asked to move between two states the lifecycle does not connect."""


class SpawnError(SupervisorError):
    """The engine's command could not be executed; the message names the command."""


class EngineFailed(SupervisorError):
    """A started engine failed; ``reason`` says how, ``exit_code`` is set when it exited."""

    def __init__(self, reason: str, *, exit_code: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


class RecordError(SupervisorError):
    """An engine record under the state directory cannot be read; the message names it."""


class SocketFolderError(SupervisorError):
    """A KV event socket folder others could use; the message names it and what is wrong."""
