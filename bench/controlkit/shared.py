"""The control benchmark's constants, counts of integer milliseconds, and pinning."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

HOST = "127.0.0.1"
FIXTURE = "dgx-h100"
RTT_LIMIT_MS = 1000
READ_LIMIT = 16 << 20  # largest reply line from a worker
LAG_TICK_S = 0.1
CLIENT_LAG_NOTE_MS = 20  # agents' loop lag above this: the load generator shows in RTT
NOISY_OTHER_UTIL = 0.10  # other processes above 10% of a core during a window: say so
REGISTER_STALL_S = 60.0  # a step fails when no agent registers for this long


# ======================================================================================
# Shared: counts of integer milliseconds, and pinning
# ======================================================================================


def merge_counts(parts: Sequence[Mapping[str, int] | Mapping[int, int]]) -> Counter[int]:
    """Merge ``{ms: count}`` histograms (JSON turns their keys into strings)."""
    merged: Counter[int] = Counter()
    for part in parts:
        for key, count in part.items():
            merged[int(key)] += count
    return merged


def percentile(counts: Mapping[int, int], q: float) -> int | None:
    """Nearest-rank percentile of a ``{value: count}`` histogram; None when empty."""
    total = sum(counts.values())
    if not total:
        return None
    rank, seen = max(1, math.ceil(q * total)), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return max(counts)


def pin_to(cpu: int) -> Callable[[], None]:
    """A ``preexec_fn`` that pins the child process to one CPU."""

    def pin() -> None:
        os.sched_setaffinity(0, {cpu})

    return pin
