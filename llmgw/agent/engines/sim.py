"""``sim``: the simulated vLLM (``llmgw sim-engine``) with exactly the vLLM adapter's flags.

``llmgw sim-engine`` accepts the ``vllm serve`` command line (with ``serve`` optional), so
this adapter is the vLLM adapter with another name and binary: engine ``sim`` and
``--engine-bin vllm="python -P -m llmgw sim-engine"`` give the same argv after the binary
(``-P``: a folder named ``llmgw`` in the working directory cannot shadow the package).
"""

from __future__ import annotations

from llmgw.agent.engines.vllm import VllmAdapter
from llmgw.command import LLMGW_COMMAND


class SimAdapter(VllmAdapter):
    """``python -P -m llmgw sim-engine serve MODEL …``: a vLLM command line for the simulator."""

    name = "sim"
    default_binary: tuple[str, ...] = (*LLMGW_COMMAND, "sim-engine")
