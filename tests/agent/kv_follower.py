"""An agent's KV event subscriber in a process of its own, so a test can read its memory.

``python kv_follower.py FOLDER MAX_BLOCKS`` follows the engine publishing on
``ipc://FOLDER/pub`` (replay on ``FOLDER/replay``) as shard ``s1`` with a `KvEventHub`
whose mirrors hold at most MAX_BLOCKS blocks, and every 50 ms prints one JSON line: the
subscriber's counters and the process's ``VmRSS`` and ``VmHWM`` (peak) in KiB, from
/proc/self/status. It runs until its stdin closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys

from llmgw.agent.engines.base import KvEventEndpoints
from llmgw.agent.kvevents import KvFollowConfig
from llmgw.agent.kvhub import KvEventHub


def memory_kib() -> dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {name: int(fields[name].split()[0]) for name in ("VmRSS", "VmHWM")}


async def main(folder: str, max_blocks: int) -> None:
    config = KvFollowConfig(flush_interval_s=0.01, replay_timeout_s=0.5, max_blocks=max_blocks)
    hub = KvEventHub(config)
    hub.follow("s1", KvEventEndpoints(f"ipc://{folder}/pub", f"ipc://{folder}/replay"))
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    closed = asyncio.ensure_future(stdin.read())
    try:
        while not closed.done():
            hub.take_deltas()  # as the stream would: deltas do not pile up
            counters = dataclasses.asdict(hub.counters()["s1"])
            sys.stdout.write(json.dumps({**counters, **memory_kib()}) + "\n")
            sys.stdout.flush()
            await asyncio.wait([closed], timeout=0.05)
    finally:
        await hub.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
