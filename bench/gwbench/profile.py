"""Where our gateway's time goes: py-spy samples each llmgw gateway (not pausing it) under the
throughput cell's load, after the measured cells; the samples summed by innermost frame."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.gwbench.load import Meter, Work, make_work, run_cell
from bench.gwbench.settings import Settings, Timing
from bench.gwbench.workload import Prompt
from bench.kit import Child


@dataclass(frozen=True, slots=True)
class Profile:
    proxy: str
    samples: int  # non-idle samples
    self_by_file: Mapping[str, int]  # the file of the innermost frame → samples
    self_by_function: Mapping[str, int]  # "function (file)" of the innermost frame → samples


def parse_raw_profile(proxy: str, text: str) -> Profile:
    """py-spy's ``--format raw --function`` output (``name (file:line);... count`` per line) by
    innermost frame."""
    by_file: Counter[str] = Counter()
    by_function: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        inner = stack.rsplit(";", 1)[-1]
        by_function[inner] += int(count)
        where = inner.rpartition(" (")[2].rstrip(")")  # "file:first line of the function"
        by_file[where.rpartition(":")[0] or where] += int(count)
    return Profile(proxy, sum(by_function.values()), by_file, by_function)


async def profile_gateway(name: str, child: Child, work: Work, s: Settings, out: Path) -> Profile:
    """Sample ``child`` with py-spy (not pausing it) under ``work`` for ``s.timing.seconds``."""
    raw = out / (name.replace(" ", "-") + ".raw.txt")
    seconds = max(1, round(s.timing.seconds))
    spy = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(child.proc.pid),
        "--duration", str(seconds), "--rate", "250", "--format", "raw", "--nonblocking",
        "--function", "--output", str(raw),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    meter = Meter(None, None, s.proxy_cpu, s.client_cpu)
    load = asyncio.create_task(
        run_cell(name, child.ports, work, meter, 0, Timing(seconds + 1.0, 0.0))
    )
    try:
        if await spy.wait() != 0 or not raw.exists():
            raise RuntimeError(f"py-spy failed on {name} (pid {child.proc.pid})")
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
    return parse_raw_profile(name, raw.read_text())


async def profile_gateways(
    children: Mapping[str, Child], s: Settings, prompts: Sequence[Prompt]
) -> list[Profile]:
    """With ``s.profile``, each of our gateways profiled under the throughput cell's load."""
    if s.profile is None:
        return []
    return [
        await profile_gateway(name, child, make_work("rps", s, child.ports, prompts), s, s.profile)
        for name, child in children.items()
        if name.startswith("llmgw")
    ]


def profile_lines(profile: Profile, top: int = 12) -> list[str]:
    def share(n: int) -> str:
        return f"{100 * n / profile.samples:4.1f}%"

    lines = [f"{profile.proxy}: {profile.samples:,} samples, innermost frame by file:"]
    lines += [f"  {share(n)}  {f}" for f, n in Counter(profile.self_by_file).most_common(top)]
    lines += ["  by function:"]
    lines += [f"  {share(n)}  {f}" for f, n in Counter(profile.self_by_function).most_common(top)]
    return lines
