"""``--db`` of ``llmgw server`` and ``llmgw token``: a path is an SQLite file, a
``postgresql://`` URL a PostgreSQL database, anything else with a scheme is refused, and a
password in the URL is never shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from serverflags import server_config

from llmgw.cli.errors import CliError
from llmgw.cli.main import main
from llmgw.server.state.storebackend import PostgresUrl


def test_the_server_takes_a_path_or_a_postgresql_url(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert server_config(monkeypatch, "--db", str(tmp_path / "s.db")).db_path == tmp_path / "s.db"
    url = "postgresql://llmgw:s3cret@127.0.0.1:5432/llmgw"
    config = server_config(monkeypatch, "--db", url)
    assert config.db_path == PostgresUrl(url)
    assert "s3cret" not in repr(config) and "s3cret" not in str(config.db_path)


def test_the_server_refuses_a_malformed_url_naming_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(CliError, match=r"^--db 'postgresql://u:\*\*\*@h:5432' .*no database"):
        server_config(monkeypatch, "--db", "postgresql://u:pw@h:5432")


def test_token_refuses_another_scheme_and_writes_to_postgresql(
    capsys: pytest.CaptureFixture[str], pg_url: str
) -> None:
    assert main(["token", "list", "--db", "mysql://u:pw@h/d"]) != 0
    err = capsys.readouterr().err
    assert "--db 'mysql://u:***@h/d': only postgresql:// URLs" in err and ":pw@" not in err
    assert main(["token", "create", "--role", "admin", "--note", "ops", "--db", pg_url]) == 0
    token = capsys.readouterr().out.strip()
    assert len(token) > 20
    assert main(["token", "list", "--db", pg_url]) == 0
    assert " admin " in capsys.readouterr().out
    assert main(["token", "revoke", "1", "--db", pg_url]) == 0
    assert main(["token", "revoke", "1", "--db", pg_url]) != 0


def test_the_demo_takes_a_postgresql_url_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from llmgw.cli import demo

    asked: list[demo.DemoOptions] = []

    def run_demo(options: demo.DemoOptions) -> int:
        asked.append(options)
        return 0

    monkeypatch.setattr(demo, "run_demo", run_demo)
    url = "postgresql://llmgw:pw@127.0.0.1:5432/demo"
    assert main(["demo", "--headless", "--db", url]) == 0
    assert [o.db for o in asked] == [url]
    assert main(["demo", "--headless", "--db", "state.db"]) != 0
    assert "the demo takes a postgresql:// URL" in capsys.readouterr().err
    assert main(["demo", "--headless", "--db", "postgresql://u:pw@h"]) != 0
    err = capsys.readouterr().err
    assert "no database name" in err and ":pw@" not in err
    assert main(["demo", "--headless"]) == 0 and asked[-1].db is None
