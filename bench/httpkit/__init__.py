"""The parts of the gRPC-web HTTP benchmark (``python -m bench.http``, which holds the
orchestration, the report and the command line): the constants and ``Settings``
(``settings``), the server mode ``_serve`` (``serve``), the workloads and their checks
(``workload``) and one measured cell (``cell``). They import ``bench.kit``, each other and
``llmgw``."""
