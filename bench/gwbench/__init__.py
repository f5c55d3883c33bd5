"""The parts of the gateway benchmark (``python -m bench.gateway``): the workload (prompts and
requests), the fast upstream, the settings and proxies measured, the load generator and its
cells, the py-spy profile and the report. They import ``bench.kit`` and each other."""
