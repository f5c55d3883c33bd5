"""Where a follower's own gateway starts its feed: this server's own native port as dialled
(``llmgw.server.wire.followergateway.own_address``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from llmgw.server.wire.followergateway import own_address


@dataclass
class _Lead:
    address: str


@pytest.mark.parametrize(
    ("advertised", "dialled"),
    [
        ("10.0.0.7:50051", ("10.0.0.7", 50051)),  # --advertise, as agents dial it
        ("ctl.example:443", ("ctl.example", 443)),  # the name its certificate holds
        ("0.0.0.0:50051", ("127.0.0.1", 50051)),  # --grpc-listen on every address
        ("[::]:50051", ("::1", 50051)),
        ("[fd00::1]:7", ("fd00::1", 7)),
    ],
)
def test_own_address_is_the_advertised_one_and_a_wildcard_is_loopback(
    advertised: str, dialled: tuple[str, int]
) -> None:
    lead: Any = _Lead(advertised)
    assert own_address(lead) == dialled
