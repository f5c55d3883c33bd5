"""``llmgw``: one entry point with subcommands (see ``llmgw --help``)."""

from llmgw.cli.main import main

__all__ = ["main"]
