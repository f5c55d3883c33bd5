"""bench/failover.py's judgement of what the servers say: one leader, a higher epoch, and a
split brain caught."""

from __future__ import annotations

import pytest

from bench.failover import SplitBrain, _follows, _leader, _led_after, _poll


class _Says:
    def __init__(self, name: str, said: tuple[int, int] | None) -> None:
        self.name, self._said = name, said

    def leader(self, client: object) -> tuple[int, int] | None:
        return self._said


def test_the_leader_and_a_higher_epoch_are_read_from_what_the_servers_say() -> None:
    seen = _poll([_Says("a", (0, 3)), _Says("b", (1, 4)), _Says("c", None)], None)  # type: ignore[list-item,arg-type]
    assert seen == {"a": (0, 3), "b": (1, 4)}
    assert _leader(seen) == ("b", 4)
    assert _led_after(3, seen) and not _led_after(4, seen)
    assert _follows("a", seen) and not _follows("b", seen) and not _follows("c", seen)


def test_two_servers_saying_they_lead_is_a_split_brain() -> None:
    with pytest.raises(SplitBrain, match="two servers lead at once"):
        _poll([_Says("a", (1, 3)), _Says("b", (1, 4))], None)  # type: ignore[list-item,arg-type]
