"""Which server of the database leads, as the console's overview says it (pure)."""

from __future__ import annotations

from llmgw.api.llmgw.v1 import Leadership

__all__ = ["leader_words"]


def leader_words(leadership: Leadership | None) -> str:
    """``ID at HOST:PORT, epoch N`` (the ID left out when it is the address), and whether
    the answering server is it; "" when the snapshot names no leader."""
    if leadership is None or not leadership.leader_id:
        return ""
    named = "" if leadership.leader_id == leadership.leader_address else f"{leadership.leader_id} "
    where = f"{named}at {leadership.leader_address}, epoch {leadership.epoch}"
    return f"{where} (this server)" if leadership.leading else f"{where} (not this server)"
