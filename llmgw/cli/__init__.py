"""``llmgw``: one entry point with subcommands (see ``llmgw --help``).

What lives here, top to bottom; a module imports only modules below it, and the modules of
one row never import each other (the "command line in layers" import-linter contract in
pyproject.toml holds it; tests/cli/test_import_graph.py checks the graph has no cycle):

- ``main``: the list of commands, the logging setup and the one place a ``CliError`` is
  printed.
- ``demo_command`` (``llmgw demo``'s flags), then ``demo`` (the demo itself, which prints
  ``llmgw get``'s tables).
- The commands, each registering its subcommands and what runs them: ``server``, ``agent``,
  ``get`` (also ``cordon``, ``uncordon``), ``actions`` (``start``, ``drain``, ``reprofile``,
  ``drain-node``), ``logs``, ``desired`` (``apply``, ``delete``, ``events``), ``history``
  (``describe``, ``scale``, ``rollout``), ``simengine``, ``gateway``, ``console``, ``token``,
  ``tenantkeys`` (``key``), ``db`` (``db migrate``).
- What the heavy commands run, imported only when they run: ``serve`` (the server and the
  agent), ``apply`` (the desired state), ``describe`` (describe, scale and rollout).
- ``rpc``: calling the control server over gRPC-web (its flags, its token and CA, one call
  helper).
- Shared flags and helpers: ``flags``, ``tls``, ``apikeys``, ``browsers``, ``httplimits``,
  ``autoscale_text`` (the autoscaler in tables and describe),
  ``tables``, ``screenlog``.
- ``errors``: ``CliError``.

Beyond the package, it may import every other part of llmgw (it is what starts them); of
llmgw, only ``llmgw.__main__`` (``python -m llmgw``) imports it.
"""

from llmgw.cli.main import main

__all__ = ["main"]
