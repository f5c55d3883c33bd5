"""``llmgw agent --server a,b,c``: the comma list of control servers (issue #17)."""

from __future__ import annotations

import pytest

from llmgw.agent.daemon import AgentConfigError, parse_servers
from llmgw.cli.main import build_parser


def test_a_comma_list_is_parsed_in_order_and_duplicates_collapse() -> None:
    servers = parse_servers("a:50051, b:50052,[::1]:7,a:50051")
    assert servers == [("a", 50051), ("b", 50052), ("::1", 7)]
    assert parse_servers("127.0.0.1:50051") == [("127.0.0.1", 50051)]


@pytest.mark.parametrize(
    ("text", "named"),
    [("a:1,b", "'b'"), ("a:1,,b:2", "empty entry"), ("a:1,http://b:2", "http://b:2")],
)
def test_a_malformed_entry_is_named(text: str, named: str) -> None:
    with pytest.raises(AgentConfigError, match=named):
        parse_servers(text)


def test_the_agent_flag_takes_and_explains_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["agent", "--server", "a:1,b:2"])
    assert parse_servers(args.server) == [("a", 1), ("b", 2)]
    with pytest.raises(SystemExit):
        parser.parse_args(["agent", "--help"])
    assert "comma list" in " ".join(capsys.readouterr().out.split())


def test_the_gateway_flag_takes_a_comma_list() -> None:
    from llmgw.cli.errors import CliError
    from llmgw.cli.gateway import server_list

    assert server_list("a:1,b:2,a:1") == [("a", 1), ("b", 2)]
    for text, named in [("a:1,b", "'b'"), ("a:1,", "empty entry"), ("a:0", "port 0")]:
        with pytest.raises(CliError, match=named):
            server_list(text)
