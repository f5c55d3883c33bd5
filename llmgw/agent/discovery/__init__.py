"""What a node is: its GPUs (through NVML, or simulated from fixtures) and host.

``nvml_node`` describes this machine through NVML and its files, and ``NvmlTelemetry``
samples its GPUs; ``simulated_node`` describes a node from a topology fixture and
``SimulatedTelemetry`` animates it; ``llmgw.agent.discovery.host`` reads host facts.
"""

from llmgw.agent.discovery.errors import DiscoveryError, FixtureError
from llmgw.agent.discovery.host import (
    cpu_count,
    host_facts,
    host_memory,
    infiniband_hcas,
    local_weights,
    storage,
)
from llmgw.agent.discovery.nvml import NvmlGpus, gpu_class, nvml_gpus, nvml_node
from llmgw.agent.discovery.nvml_telemetry import NvmlTelemetry
from llmgw.agent.discovery.simulated import (
    SimulatedTelemetry,
    available_fixtures,
    load_fixture,
    simulated_node,
)

__all__ = [
    "DiscoveryError",
    "FixtureError",
    "NvmlGpus",
    "NvmlTelemetry",
    "SimulatedTelemetry",
    "available_fixtures",
    "cpu_count",
    "gpu_class",
    "host_facts",
    "host_memory",
    "infiniband_hcas",
    "load_fixture",
    "local_weights",
    "nvml_gpus",
    "nvml_node",
    "simulated_node",
    "storage",
]
