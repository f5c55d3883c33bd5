"""The parts of the control benchmark (``python -m bench.control``, which holds its two phases
and its command line): the constants, millisecond counts and pinning (``shared``), the worker
modes ``_agents`` and ``_echo`` (``workers``), the child processes and /proc readings
(``children``), the settings and one measured step (``step``) and the report (``report``).
They import ``bench.kit``, each other and ``llmgw``."""
