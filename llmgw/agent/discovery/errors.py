"""Discovery's exceptions.

::

    DiscoveryError          the node's GPUs or host cannot be described as asked
    └── FixtureError        a simulated topology fixture cannot be read or is malformed
                            (the message names the file and the key path that is wrong)

Asking for a simulated fixture that does not exist raises ``DiscoveryError`` naming the
fixtures that do. Host facts never raise: a missing or unreadable file leaves its fields
empty. Foreign exceptions (``OSError``, ``json.JSONDecodeError``) are mapped to these at
the one place each is caught, ``raise … from exc``.
"""

from __future__ import annotations


class DiscoveryError(Exception):
    """Base of discovery's own exceptions."""


class FixtureError(DiscoveryError):
    """A simulated topology fixture cannot be read or is malformed."""
