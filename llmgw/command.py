"""How llmgw starts itself in a child process: ``python -P -m llmgw``.

``python -m`` puts the working directory first on ``sys.path``, so a folder named
``llmgw`` there (a clone of this repository in ``~``) would be imported instead of the
installed package and the child would die with an ImportError. ``-P`` (Python 3.11+, as
``PYTHONSAFEPATH``) leaves the working directory out. Every llmgw child (the demo's
server, agents and console, the simulated engines an agent starts) is started with it.
"""

from __future__ import annotations

import sys
from typing import Final

__all__ = ["LLMGW_COMMAND"]

LLMGW_COMMAND: Final[tuple[str, ...]] = (sys.executable, "-P", "-m", "llmgw")
"""The argv prefix that runs the ``llmgw`` command of this interpreter's installation."""
