#!/usr/bin/env python3
"""Benchmark: KV blocks from an engine's ZMQ frames to the gateway's index; lookups; memory.

Four figures, each beside a baseline measured in the same run:

* **Blocks per second, frame to index.** An engine's event stream in vLLM's own format
  (``encode_batch`` map encoding + ``encode_frames``; steps of several ``BlockStored``
  events of 1–32 blocks of 16 tokens, chained by parent hash, and one ``BlockRemoved`` per
  evicted block once its cache is full) is pushed, single-threaded, through every stage the
  blocks cross: ``decode_frames`` + ``decode_batch`` → the agent's ``BlockMirror`` (our
  block keys: blake2b over the tokens) → its net delta packed as a ``KvDelta`` inside an
  ``AgentMessage``, serialized and parsed by the server's checked codec → ``decode_kv_delta``
  → the server's ``KvBlocks`` → a feed watcher's ``KvBlocks`` event, serialized and parsed
  → ``apply_kv_blocks`` → ``KvIndex``. Blocks counted: stored plus removed, as the frames
  carry them. Target: 200,000 a second. The agent flushes every ``--flush-blocks`` block
  events (what its 30 ms flush window holds at 200,000 a second). Stages are timed in CPU
  seconds of this process (``time.process_time``), not wall time, as the machine is shared;
  besides the one-thread rate, the rate as deployed: agent, server and gateway are
  separate processes, so the slowest of the three sets the pace.
* **Lookup cost.** ``KvIndex.match`` over a request of 47 blocks (6k tokens in 128-token
  blocks) and 375 blocks (16-token blocks) against 8 and 100 candidates, in the index of the
  memory figure, where one replica holds the request's whole chain and every replica its
  first 32 blocks (a shared system prompt). Baseline: the same match over one Python
  ``set`` per replica (stop at each one's first miss).
* **Block keys.** ``block_keys`` (one blake2b pass per block, as the agent's mirror and the
  gateway compute our keys) over a 6k-token prompt in 16- and 128-token blocks. Baseline:
  the previous definition's code (three blake2b calls per block and an int round trip per
  parent, before the precise tier's rework), which gives the same keys (checked).
* **Bytes per indexed block** at ``--replicas`` × ``--blocks`` (100 × 100,000), measured
  with ``tracemalloc`` while the index is built: every replica holding its own blocks (the
  worst case: no sharing), and the control server's store (``KvBlocks``: one ``KeySet`` per
  replica) for the same blocks. Baselines, measured on one replica's blocks: a Python
  ``set`` of ints per replica and one ``dict`` of key → holder bitmask.

    .venv/bin/python -m bench.kvindex             # full size (several minutes)
    .venv/bin/python -m bench.kvindex --quick     # small sizes, seconds
    .venv/bin/python -m bench.kvindex --markdown  # also a BENCHMARKS.md section
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from bench.kit import base_machine, command_line
from llmgw.api.llmgw.v1 import AgentMessage, KvDelta, RouterFeedEvent
from llmgw.gateway.feed import apply_kv_blocks
from llmgw.gateway.routing.kvindex import KvIndex
from llmgw.kvcache import (
    BlockRemoved,
    BlockStored,
    decode_batch,
    decode_frames,
    encode_batch,
    encode_frames,
)
from llmgw.kvcache.keys import pack_keys, unpack_keys
from llmgw.kvcache.mirror import ROOT_KEY, BlockMirror, MirrorDelta, block_keys
from llmgw.server.state.kvblocks import KvBlocks, KvWatcher, decode_kv_delta
from llmgw.server.wire.codec import decode_message

TARGET = 200_000  # blocks per second, frame to index
TOPIC = "kv-events"
SHARED_PREFIX = 32  # blocks of the request every replica holds (a system prompt)


# --- the event stream ------------------------------------------------------------------------


@dataclass(slots=True)
class _Engine:
    """A fake engine's cache: FIFO eviction at ``capacity`` blocks, requests as chains."""

    rng: random.Random
    capacity: int
    block_size: int = 16
    cached: list[int] = field(default_factory=list)
    head: int = 0  # index in ``cached`` of the oldest block still cached
    chains: list[int | None] = field(default_factory=list)  # last block of running requests

    def step(self, stores: int) -> list[BlockStored | BlockRemoved]:
        events: list[BlockStored | BlockRemoved] = []
        for _ in range(stores):
            slot = self.rng.randrange(8)
            while len(self.chains) <= slot:
                self.chains.append(None)
            if self.rng.random() < 0.15:
                self.chains[slot] = None  # a new request
            count = self.rng.choice((1, 1, 2, 4, 8, 16, 32))
            hashes = tuple(self.rng.getrandbits(64) for _ in range(count))
            tokens = tuple(self.rng.randrange(128_000) for _ in range(count * self.block_size))
            events.append(BlockStored(hashes, self.chains[slot], tokens, self.block_size))
            self.chains[slot] = hashes[-1]
            self.cached += hashes
        while len(self.cached) - self.head > self.capacity:
            events.append(BlockRemoved((self.cached[self.head],)))
            self.head += 1
        return events


def event_stream(blocks: int, capacity: int, seed: int) -> tuple[list[list[bytes]], int]:
    """ZMQ frames of ``blocks`` block events (stored + removed), and the exact count."""
    engine = _Engine(random.Random(seed), capacity)
    frames: list[list[bytes]] = []
    total, seq = 0, 0
    while total < blocks:
        events = engine.step(stores=4)
        total += sum(len(e.block_hashes) for e in events)
        payload = encode_batch(1_700_000_000.0 + seq / 100, events, 0)
        frames.append(encode_frames(TOPIC, seq, payload))
        seq += 1
    return frames, total


# --- frame to index --------------------------------------------------------------------------


def _kv_delta(delta: MirrorDelta, mirror: BlockMirror, seq: int) -> KvDelta:
    """One agent delta as the agent packs it (removals and stores in one message)."""
    return KvDelta(
        shard_id="r0.0",
        reset=delta.reset,
        stored=pack_keys(delta.stored),
        stored_keys=pack_keys(delta.stored_keys),
        removed=pack_keys(delta.removed),
        removed_keys=pack_keys(delta.removed_keys),
        seq=seq,
        block_size=mirror.block_size,
        oldest_event_ts=delta.oldest_event_ts,
    )


PROCESSES = {
    "agent": ("decode", "mirror", "agent_send"),
    "server": ("server_receive", "server_store", "feed_send"),
    "gateway": ("gateway_receive", "index"),
}


@dataclass(slots=True)
class Stages:
    """Seconds spent per stage of the pipeline, in the order blocks cross them."""

    decode: float = 0.0  # agent: decode_frames + decode_batch
    mirror: float = 0.0  # agent: BlockMirror.apply (block keys)
    agent_send: float = 0.0  # agent: take_delta, pack, serialize the AgentMessage
    server_receive: float = 0.0  # server: checked codec, decode_kv_delta
    server_store: float = 0.0  # server: KvBlocks.apply
    feed_send: float = 0.0  # server: the watcher's KvBlocks events, serialized
    gateway_receive: float = 0.0  # gateway: parse the RouterFeedEvents
    index: float = 0.0  # gateway: apply_kv_blocks → KvIndex

    def total(self) -> float:
        return float(sum(asdict(self).values()))


def _flush(mirror: BlockMirror, blocks: KvBlocks, watcher: KvWatcher, index: KvIndex,
           stages: Stages, seq: int) -> None:  # fmt: skip
    clock = time.process_time  # CPU time: the machine is shared with other work
    t0 = clock()
    data = bytes(AgentMessage(kv_delta=_kv_delta(mirror.take_delta(), mirror, seq)))
    t1 = clock()
    received = decode_kv_delta(decode_message(data, AgentMessage).kv_delta or KvDelta())
    t2 = clock()
    blocks.apply("n1", "r0", received)
    t3 = clock()
    sent = [bytes(RouterFeedEvent(kv_blocks=e)) for e in watcher.take(1 << 30)]
    t4 = clock()
    parsed = [RouterFeedEvent.parse(data).kv_blocks for data in sent]
    t5 = clock()
    for event in parsed:
        assert event is not None
        apply_kv_blocks(index, event)
    t6 = clock()
    stages.agent_send += t1 - t0
    stages.server_receive += t2 - t1
    stages.server_store += t3 - t2
    stages.feed_send += t4 - t3
    stages.gateway_receive += t5 - t4
    stages.index += t6 - t5


def frame_to_index(frames: list[list[bytes]], flush_blocks: int) -> tuple[Stages, KvIndex]:
    """Every frame through every stage, the agent flushing every ``flush_blocks`` block
    events; seconds per stage, and the index at the end."""
    mirror, blocks, index, stages = BlockMirror(), KvBlocks(), KvIndex(), Stages()
    clock, window = time.process_time, 0
    with blocks.watch() as watcher:
        watcher.mark_full([])
        for i, frame in enumerate(frames):
            t0 = clock()
            batch = decode_batch(decode_frames(frame)[2])
            t1 = clock()
            mirror.apply(batch)
            stages.decode += t1 - t0
            stages.mirror += clock() - t1
            window += sum(
                len(e.block_hashes)
                for e in batch.events
                if isinstance(e, BlockStored | BlockRemoved)
            )
            if window >= flush_blocks or i + 1 == len(frames):
                _flush(mirror, blocks, watcher, index, stages, i)
                window = 0
    if sorted(index.keys_of("r0")) != sorted(k for k in mirror.blocks().values() if k):
        raise SystemExit("the index does not hold what the engine holds: a bug")
    return stages, index


# --- memory ----------------------------------------------------------------------------------


def _traced(build: Callable[[], object]) -> tuple[object, int]:
    """What ``build`` returns and the bytes it left allocated (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        built = build()
        gc.collect()
        return built, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _replica_keys(replicas: int, blocks: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(64) | 1 for _ in range(blocks)] for _ in range(replicas)]


def _build_index(keys: list[list[int]], chunk: int = 32_768) -> KvIndex:
    index = KvIndex()
    for n, replica in enumerate(keys):
        for i in range(0, len(replica), chunk):
            index.apply(f"r{n}", i == 0, replica[i : i + chunk])
    return index


def _build_store(keys: list[list[int]], chunk: int = 32_768) -> KvBlocks:
    store = KvBlocks()
    for n, replica in enumerate(keys):
        for i in range(0, len(replica), chunk):
            part = replica[i : i + chunk]
            delta = KvDelta(shard_id=f"r{n}.0", reset=i == 0, stored=pack_keys(part),
                            stored_keys=pack_keys(part))  # fmt: skip
            store.apply("n1", f"r{n}", decode_kv_delta(delta))
    return store


def _build_sets(packed: list[bytes]) -> list[set[int]]:
    """Baseline: a set per replica, its ints its own (made from the wire form, as a
    gateway would)."""
    return [set(unpack_keys(replica)) for replica in packed]


def _build_bitmask_dict(packed: list[bytes]) -> dict[int, int]:
    """Baseline: one dict of key → holder bitmask (masks of one bit are shared)."""
    masks: dict[int, int] = {}
    bits = [1 << n for n in range(len(packed))]
    for n, replica in enumerate(packed):
        bit = bits[n]
        for key in unpack_keys(replica):
            masks[key] = masks.get(key, 0) | bit
    return masks


# --- lookups ---------------------------------------------------------------------------------


def _set_match(
    sets: dict[str, set[int]], keys: Sequence[int], candidates: Sequence[str]
) -> dict[str, int]:
    found: dict[str, int] = {}
    for replica_id in candidates:
        held, n = sets[replica_id], 0
        for key in keys:
            if key not in held:
                break
            n += 1
        found[replica_id] = n
    return found


def _per_call_us(call: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    """The best of 7 timed loops of 200 calls, in µs per call (``before`` each call,
    untimed): on a machine shared with other work, the cost of the call itself."""
    samples = []
    for _ in range(7):
        spent = 0.0
        for _ in range(200):
            if before is not None:
                before()
            start = time.perf_counter()
            call()
            spent += time.perf_counter() - start
        samples.append(spent / 200 * 1e6)
    return min(samples)


def lookups(index: KvIndex, keys: list[list[int]], seed: int) -> list[dict[str, object]]:
    """Match cost for long and short requests, few and many candidates, vs plain sets."""
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) | 1 for _ in range(375)]
    index.apply("r0", False, chain)
    for n in range(1, len(keys)):
        index.apply(f"r{n}", False, chain[:SHARED_PREFIX])
    sets = {f"r{n}": set(chain[:SHARED_PREFIX]) for n in range(len(keys))}
    sets["r0"].update(chain)
    rows: list[dict[str, object]] = []
    for blocks in (47, 375):
        request = chain[:blocks]
        for count in (8, len(keys)):
            candidates = [f"r{n}" for n in range(count)]
            found = index.match(request, candidates)
            assert found == _set_match(sets, request, candidates), "index and sets disagree"
            call = partial(index.match, request, candidates)
            cold_us = _per_call_us(call, before=index._hot.clear)  # nothing found lately
            warm_us = _per_call_us(call)  # the same request again: the hot dict answers
            sets_us = _per_call_us(partial(_set_match, sets, request, candidates))
            rows.append({"blocks": blocks, "candidates": count, "cold_us": cold_us,
                         "warm_us": warm_us, "sets_us": sets_us})  # fmt: skip
    return rows


# --- block keys ------------------------------------------------------------------------------


def _previous_block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """Baseline: `block_keys` as llmgw computed them before the precise tier's rework (same values):
    per block, blake2b constructed with the parent's key, then two updates, an int back."""
    full = len(tokens) // block_size * block_size
    packed = array("Q", tokens[:full])
    if sys.byteorder == "big":
        packed.byteswap()
    data, step = packed.tobytes(), block_size * 8
    keys: list[int] = []
    parent = ROOT_KEY
    for offset in range(full // block_size):
        digest = hashlib.blake2b(parent.to_bytes(8, "big"), digest_size=8, person=b"llmgw-block-v1")
        digest.update(b"\x00")
        digest.update(data[offset * step : (offset + 1) * step])
        parent = int.from_bytes(digest.digest(), "big") or 1
        keys.append(parent)
    return keys


def _cpu_per_call_us(call: Callable[[], object], calls: int = 200) -> float:
    """The best of 7 loops of ``calls`` calls, in CPU µs per call (``time.process_time``, as
    for the frame-to-index stages: time another process holds the core is not counted)."""
    samples = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(calls):
            call()
        samples.append((time.process_time() - start) / calls * 1e6)
    return min(samples)


def key_costs(seed: int, prompt_tokens: int = 6_144) -> list[dict[str, float]]:
    """µs per block of `block_keys` and of the previous code, over one long prompt."""
    rng = random.Random(seed)
    tokens = [rng.randrange(128_000) for _ in range(prompt_tokens)]
    rows: list[dict[str, float]] = []
    for size in (16, 128):
        if block_keys(tokens, size) != _previous_block_keys(tokens, size):
            raise SystemExit("block_keys no longer gives the previous definition's keys")
        blocks = prompt_tokens // size
        now = _cpu_per_call_us(partial(block_keys, tokens, size)) / blocks
        previous = _cpu_per_call_us(partial(_previous_block_keys, tokens, size)) / blocks
        rows.append({"block_size": size, "now_us": now, "previous_us": previous})
    return rows


# --- report ----------------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = _load()
    frames, total = event_stream(args.stream_blocks, args.engine_capacity, args.seed)
    frame_to_index(frames[:200], args.flush_blocks // 10)  # warm-up: first-use imports
    stages, _ = frame_to_index(frames, args.flush_blocks)
    keys = _replica_keys(args.replicas, args.blocks, args.seed + 1)
    pairs = args.replicas * args.blocks
    index, index_bytes = _traced(lambda: _build_index(keys))
    _, store_bytes = _traced(lambda: _build_store(keys))
    one = [pack_keys(keys[0])]
    _, sets_bytes = _traced(lambda: _build_sets(one))
    _, dict_bytes = _traced(lambda: _build_bitmask_dict(one))
    assert isinstance(index, KvIndex)
    rows = lookups(index, keys, args.seed + 2)
    key_rows = key_costs(args.seed + 3)
    seconds = asdict(stages)
    per_process = {name: sum(seconds[s] for s in group) / total * 1e6
                   for name, group in PROCESSES.items()}  # fmt: skip
    return {
        "command": command_line(), "machine": base_machine(), "load_at_start": started,
        "stream": {"blocks": total, "frames": len(frames), "seconds": seconds,
                   "flush_blocks": args.flush_blocks, "us_per_block": per_process,
                   "blocks_per_s": total / stages.total(),
                   "pipelined_blocks_per_s": 1e6 / max(per_process.values())},
        "memory": {"replicas": args.replicas, "blocks": args.blocks,
                   "index_bytes_per_block": index_bytes / pairs,
                   "store_bytes_per_block": store_bytes / pairs,
                   "set_bytes_per_block": sets_bytes / args.blocks,
                   "bitmask_dict_bytes_per_block": dict_bytes / args.blocks,
                   "index_mib": index_bytes / 2**20, "store_mib": store_bytes / 2**20},
        "lookups": rows,
        "block_keys": key_rows,
    }  # fmt: skip


def _stream_lines(stream: dict[str, Any]) -> list[str]:
    seconds, total = stream["seconds"], stream["blocks"]
    rate, pipelined = stream["blocks_per_s"], stream["pipelined_blocks_per_s"]
    lines = [
        f"Frame to index: {total:,} block events (stored + removed) in {stream['frames']:,} "
        f"frames, the agent flushing every {stream['flush_blocks']:,}.",
        f"All stages in one thread (CPU time): {rate:,.0f} blocks/s ({rate / TARGET:.2f}× "
        f"the 200,000 "
        f"target); as deployed (agent, server and gateway are separate processes, the "
        f"slowest sets the pace): {pipelined:,.0f} blocks/s ({pipelined / TARGET:.2f}×).",
        "",
        "| process | stage | µs per block | share |",
        "|---|---|---:|---:|",
    ]
    whole = sum(seconds.values())
    for process, group in PROCESSES.items():
        for stage in group:
            spent = seconds[stage]
            lines.append(
                f"| {process} | {stage} | {spent / total * 1e6:.2f} | {spent / whole:.0%} |"
            )
        lines.append(f"| **{process}** | all | **{stream['us_per_block'][process]:.2f}** | |")
    return lines


def _memory_lines(memory: dict[str, Any]) -> list[str]:
    lines = [f"Memory at {memory['replicas']} replicas × {memory['blocks']:,} blocks, no "
             "block shared (the worst case), tracemalloc:", "",
             "| structure | bytes per block | MiB | vs a set per replica |",
             "|---|---:|---:|---:|"]  # fmt: skip
    base = memory["set_bytes_per_block"]
    for name, key, mib in (
        ("gateway: KvIndex", "index_bytes_per_block", memory["index_mib"]),
        ("server: KvBlocks (a KeySet per replica)", "store_bytes_per_block", memory["store_mib"]),
        ("baseline: a Python set of ints per replica", "set_bytes_per_block", None),
        ("baseline: one dict key → holder bitmask", "bitmask_dict_bytes_per_block", None),
    ):
        shown = "–" if mib is None else f"{mib:,.0f}"
        lines.append(f"| {name} | {memory[key]:.1f} | {shown} | {memory[key] / base:.2f}× |")
    return lines


def _lookup_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [f"Lookups: `KvIndex.match`, one replica holding the whole request, every one its "
             f"first {SHARED_PREFIX} blocks; cold: nothing found lately, warm: the same request "
             "again; baseline: a Python set per replica; best of 7 runs of 200 calls:", "",
             "| request blocks | candidates | cold µs | cold µs/block | warm µs | warm µs/block "
             "| sets µs | cold ÷ sets |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        blocks = row["blocks"]
        lines.append(
            f"| {blocks} | {row['candidates']} | {row['cold_us']:.1f} | "
            f"{row['cold_us'] / blocks:.2f} | {row['warm_us']:.1f} | "
            f"{row['warm_us'] / blocks:.2f} | {row['sets_us']:.1f} | "
            f"{row['cold_us'] / row['sets_us']:.2f}× |"
        )
    return lines


def _key_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["Block keys: `block_keys` over a 6,144-token prompt (the agent's mirror computes the "
             "same keys per event); baseline: the previous code, same keys; CPU time, best of 7 "
             "runs of 200 calls:", "",
             "| block tokens | previous µs/block | now µs/block | previous ÷ now |",
             "|---:|---:|---:|---:|"]  # fmt: skip
    lines += [
        f"| {row['block_size']} | {row['previous_us']:.2f} | {row['now_us']:.2f} | "
        f"{row['previous_us'] / row['now_us']:.2f}× |"
        for row in rows
    ]
    return lines


def render(result: dict[str, Any], markdown: bool) -> str:
    lines = ["## KV blocks: frame to index, lookups, memory (bench/kvindex.py)", ""]
    if markdown:
        lines += ["```", str(result["command"]), "```", ""]
        lines += [f"- {k}: {v}" for k, v in result["machine"].items()]
        lines += [f"- load average at start: {result['load_at_start']}", ""]
    lines += _stream_lines(result["stream"]) + [""]
    lines += _memory_lines(result["memory"]) + [""]
    lines += _lookup_lines(result["lookups"]) + [""]
    lines += _key_lines(result["block_keys"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.kvindex", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--blocks", type=int, default=100_000, help="blocks per replica")
    p.add_argument("--stream-blocks", type=int, default=400_000, help="block events streamed")
    p.add_argument("--engine-capacity", type=int, default=50_000, help="blocks an engine holds")
    p.add_argument("--flush-blocks", type=int, default=6_000,
                   help="block events per agent delta (a 30 ms flush at 200,000/s)")  # fmt: skip
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="small sizes (tests, a smoke run)")
    p.add_argument("--json", action="store_true", help="figures as JSON on stdout")
    p.add_argument("--markdown", action="store_true", help="also print a BENCHMARKS.md section")
    args = p.parse_args(argv)
    if args.quick:
        args.replicas, args.blocks = min(args.replicas, 10), min(args.blocks, 5_000)
        args.stream_blocks, args.engine_capacity = 20_000, 5_000
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(render(result, markdown=False))
    if args.markdown:
        print("\n" + render(result, markdown=True))
    return 0 if args.quick or result["stream"]["pipelined_blocks_per_s"] >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
