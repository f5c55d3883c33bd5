"""The parts of the chaos run (``python -m bench.chaos``): the cluster it starts, its state
disk, the faults, the load, what it observes, the checks and the report. They import
``bench.kit``, each other and ``llmgw`` (the client, to watch the cluster from outside)."""
