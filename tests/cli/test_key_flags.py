"""``llmgw key``'s flags: bad values are refused before any call, naming the flag; good ones
become the request's fields (``--expires`` from a duration or an ISO-8601 time)."""

from __future__ import annotations

import argparse

import pytest

from llmgw.api.llmgw.v1 import KeyPriority, TenantKey
from llmgw.cli.main import build_parser, main
from llmgw.cli.tenantkeys import expiry_ms, key_rows, limit, models_list

NOW_S = 1_800_000_000.0


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["key", "create"], "--tenant"),
        (["key", "create", "--tenant", "t", "--rpm", "-1"], "argument --rpm: -1: from 0"),
        (["key", "create", "--tenant", "t", "--tpm", "1000000001"], "argument --tpm"),
        (["key", "create", "--tenant", "t", "--max-concurrency", "x"], "not a whole number"),
        (["key", "create", "--tenant", "t", "--models", "a,,b"], "an empty model name"),
        (["key", "create", "--tenant", "t", "--models", "a,a"], "a model named twice"),
        (["key", "create", "--tenant", "t", "--priority", "urgent"], "invalid choice"),
        (["key", "create", "--tenant", "t", "--expires", "soon"], "not a duration"),
        (["key", "create", "--tenant", "t", "--expires", "2001-01-01"], "in the past"),
        (["key", "create", "--tenant", "t", "--expires", "0d"], "more than 0"),
        (["key", "list", "-o", "yaml"], "invalid choice"),
        (["key", "revoke"], "KEY_ID"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--server", "http://127.0.0.1:1"])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_good_flags_parse() -> None:
    args = build_parser().parse_args(
        ["key", "create", "--tenant", "t", "--models", "chat, code", "--rpm", "30",
         "--priority", "batch", "--expires", "1d"]
    )  # fmt: skip
    assert (args.tenant, args.models, args.rpm, args.priority) == (
        "t",
        ["chat", "code"],
        30,
        "batch",
    )
    assert args.tpm == 0 and args.max_concurrency == 0 and args.note == ""
    assert args.expires > 0


def test_expiry_from_a_duration_or_an_iso_time() -> None:
    assert expiry_ms("90d", NOW_S) == int((NOW_S + 90 * 86_400) * 1000)
    assert expiry_ms("1d12h", NOW_S) == int((NOW_S + 36 * 3_600) * 1000)
    assert expiry_ms("30m", NOW_S) == int((NOW_S + 1_800) * 1000)
    assert expiry_ms("2027-01-31T00:00:00Z", NOW_S) == 1_801_353_600_000
    assert expiry_ms("2027-01-31T00:00:00", NOW_S) == 1_801_353_600_000  # no zone: UTC
    assert expiry_ms("2027-01-31T01:00:00+01:00", NOW_S) == 1_801_353_600_000
    with pytest.raises(argparse.ArgumentTypeError, match="in the past"):
        expiry_ms("2027-01-31T00:00:00Z", 1_801_353_600.0)


def test_limits_and_models() -> None:
    assert limit("0") == 0 and limit("1000000000") == 10**9
    with pytest.raises(argparse.ArgumentTypeError):
        limit("1e3")
    assert models_list("a") == ["a"]


def test_the_table_never_has_a_digest() -> None:
    key = TenantKey(
        key_id="k_0123456789ab", tenant="t", models=["chat"], rpm=30,
        priority=KeyPriority.BATCH, digest=b"\x01" * 32, note="n",
    )  # fmt: skip
    header, row = key_rows([key])
    assert header[0] == "KEY-ID" and row[:4] == ["k_0123456789ab", "t", "chat", "30"]
    assert row[6:] == ["batch", "never", "n"]
    assert not any("\x01" in cell or "0101" in cell for cell in row)
