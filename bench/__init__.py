"""Benchmarks and the chaos run, each a module run from the repository root:
``python -m bench.gateway``, ``bench.http``, ``bench.kvindex``, ``bench.routing`` (its
simulation in ``bench.routing_sim``), ``bench.reconcile``, ``bench.control``, ``bench.console``
``bench.chaos`` and ``bench.pg_drivers`` (asyncpg against psycopg 3 for the PostgreSQL
store); ``--help`` says how, BENCHMARKS.md holds their results. ``bench.pgcluster`` starts a
private PostgreSQL cluster (for that benchmark and the tests: tests/pgcluster.py).

What the benchmarks share is in ``bench.kit``; the gateway benchmark's parts are in
``bench.gwbench``, the control benchmark's in ``bench.controlkit``, the HTTP benchmark's in
``bench.httpkit``, the routing simulation's fleet (engines and choosers) in
``bench.routing_fleet``, the chaos run's in ``bench.chaoskit``. These modules may import
anything of ``llmgw`` (they measure it from outside and inside) and each other as ``bench.x``;
nothing in ``llmgw`` imports them. Tests find the package through pytest's ``pythonpath``
setting.
"""
