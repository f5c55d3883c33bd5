"""A gateway's part of a tenant key's fleet-wide limits (tenants.py's allowances)."""

from __future__ import annotations

import hashlib

import pytest

from llmgw.api.llmgw.v1 import KeyAllowance, TenantKey
from llmgw.gateway.errors import RateLimited
from llmgw.gateway.tenants import REBALANCE_WAIT_S, TenantRegistry

SECRET = b"sk-tenant"
AUTH = b"Bearer " + SECRET


class Clock:
    now = 100.0


def registry(rpm: int = 0, tpm: int = 0) -> tuple[TenantRegistry, Clock]:
    clock = Clock()
    reg = TenantRegistry(clock=lambda: clock.now)
    digest = hashlib.sha256(SECRET).digest()
    reg.replace([TenantKey(key_id="k", tenant="t", digest=digest, rpm=rpm, tpm=tpm)])
    return reg, clock


def admit(reg: TenantRegistry, estimate: int = 1) -> None:
    state = reg.lookup(AUTH)
    assert state is not None
    reg.admit(state, "m", "m", estimate).close()


def test_before_any_answer_the_whole_limit_holds() -> None:
    reg, _ = registry(rpm=3)
    for _ in range(3):
        admit(reg)
    with pytest.raises(RateLimited):
        admit(reg)


def test_a_part_is_enforced_and_a_refusal_says_to_retry_soon() -> None:
    reg, _ = registry(rpm=30)
    reg.apply_allowances([KeyAllowance(key_id="k", rpm=2)])
    admit(reg)
    admit(reg)
    with pytest.raises(RateLimited) as refused:
        admit(reg)
    assert refused.value.retry_after_s <= REBALANCE_WAIT_S
    assert b"x-ratelimit-limit-requests: 2" in refused.value.headers


def test_the_whole_budget_says_the_window_wait() -> None:
    reg, _ = registry(rpm=1)
    reg.apply_allowances([KeyAllowance(key_id="k", rpm=1, whole=True)])
    admit(reg)
    with pytest.raises(RateLimited) as refused:
        admit(reg)
    assert refused.value.retry_after_s == 60


def test_a_part_of_zero_refuses_and_is_not_no_limit() -> None:
    reg, _ = registry(tpm=1000)
    reg.apply_allowances([KeyAllowance(key_id="k", tpm=0)])
    with pytest.raises(RateLimited):
        admit(reg, estimate=10)


def test_windows_say_what_the_gateway_holds_and_was_asked() -> None:
    reg, clock = registry(rpm=2, tpm=100)
    admit(reg, 10)
    admit(reg, 20)
    with pytest.raises(RateLimited):
        admit(reg, 5)
    [w] = reg.windows()
    assert (w.requests, w.tokens, w.asked_requests, w.asked_tokens) == (2, 30, 3, 35)
    clock.now += 61
    [w] = reg.windows()
    assert (w.requests, w.tokens) == (0, 0)


def test_a_key_without_limits_sends_no_window_and_a_cut_off_gateway_keeps_its_part() -> None:
    reg, _ = registry()
    assert reg.windows() == []
    reg, _ = registry(rpm=10)
    reg.apply_allowances([KeyAllowance(key_id="k", rpm=1)])
    reg.apply_allowances([])  # a report answered nothing for it: the last part stays
    admit(reg)
    with pytest.raises(RateLimited):
        admit(reg)
