"""What every benchmark in scripts/ reports about itself: the command, the machine, CPU use."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Final

CLK_TCK: Final = os.sysconf("SC_CLK_TCK")


def command_line() -> str:
    """This process's command line, with the interpreter relative when it is below here."""
    python = os.path.relpath(sys.executable)
    if python.startswith(".."):
        python = sys.executable
    return shlex.join([python, *sys.argv])


def base_machine() -> dict[str, str]:
    """Cores, CPU model, Python and OS, as a benchmark's header prints them."""
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "nproc": nproc or str(os.cpu_count()),
        "cpu": model,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) from ``/proc/PID/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK
