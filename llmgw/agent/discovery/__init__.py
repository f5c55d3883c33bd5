"""What a node is: its GPUs (simulated from fixtures here; NVML on real nodes) and host.

``simulated_node`` describes a node from a topology fixture and ``SimulatedTelemetry``
animates it; ``llmgw.agent.discovery.host`` reads this machine's own host facts.
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
from llmgw.agent.discovery.simulated import (
    SimulatedTelemetry,
    available_fixtures,
    load_fixture,
    simulated_node,
)

__all__ = [
    "DiscoveryError",
    "FixtureError",
    "SimulatedTelemetry",
    "available_fixtures",
    "cpu_count",
    "host_facts",
    "host_memory",
    "infiniband_hcas",
    "load_fixture",
    "local_weights",
    "simulated_node",
    "storage",
]
