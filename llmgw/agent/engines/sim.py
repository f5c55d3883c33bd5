"""``sim``: the simulated vLLM (``llmgw sim-engine``) with exactly the vLLM adapter's flags.

``llmgw sim-engine`` accepts the ``vllm serve`` command line (with ``serve`` optional), so
this adapter is the vLLM adapter with another name and binary: engine ``sim`` and
``--engine-bin vllm="python -m llmgw sim-engine"`` give the same argv after the binary.
"""

from __future__ import annotations

import sys

from llmgw.agent.engines.vllm import VllmAdapter


class SimAdapter(VllmAdapter):
    """``python -m llmgw sim-engine serve MODEL …``: a vLLM command line for the simulator."""

    name = "sim"
    default_binary: tuple[str, ...] = (sys.executable, "-m", "llmgw", "sim-engine")
