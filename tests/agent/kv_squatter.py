"""Another local user squatting on a KV event socket folder (``nobody``, for a test).

``python kv_squatter.py FOLDER SECONDS HASH...``, started as root, becomes ``nobody`` once
its modules are loaded (``runuser -u nobody`` cannot run an interpreter kept under a 0700
home, as pyenv's under /root is), then creates FOLDER (mode 0777), binds an XPUB
at ``FOLDER/pub`` and a ROUTER at ``FOLDER/replay``, and binds them again whenever someone
else's socket takes a path (a ZMQ bind unlinks the file there first, and the folder is
ours), so whoever connects to those paths later reaches us. It publishes the given block
hashes every 20 ms as vLLM would and answers every replay with the end marker. It prints
``ready`` once bound, ``subscribed`` for each subscription and ``replay`` for each replay
request, and after SECONDS one JSON line with their counts.
"""

from __future__ import annotations

import json
import os
import pwd
import sys
import time

import zmq

from llmgw.kvcache import BlockStored, encode_batch, encode_frames, replay_end_frames

TOPIC = "kv-events"


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def become_nobody() -> None:
    """Drop root for good: every group, then the gid, then the uid."""
    nobody = pwd.getpwnam("nobody")
    os.setgroups([])
    os.setgid(nobody.pw_gid)
    os.setuid(nobody.pw_uid)
    assert os.geteuid() == nobody.pw_uid and os.getegid() == nobody.pw_gid


def main(folder: str, seconds: float, hashes: list[int]) -> None:
    become_nobody()
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o777)
    ctx = zmq.Context()
    pub_path, replay_path = os.path.join(folder, "pub"), os.path.join(folder, "replay")
    pubs: list[zmq.Socket[bytes]] = []
    routers: list[zmq.Socket[bytes]] = []
    inodes: dict[str, int] = {}
    poller = zmq.Poller()
    subscriptions = replays = seq = 0
    event = BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None,
        token_ids=tuple(range(16 * len(hashes))), block_size=16, medium="GPU",
    )  # fmt: skip

    def bind(path: str, kind: int, into: list[zmq.Socket[bytes]]) -> None:
        try:
            if os.lstat(path).st_ino == inodes.get(path):
                return
        except FileNotFoundError:
            pass
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{path}")
        inodes[path] = os.lstat(path).st_ino
        poller.register(sock, zmq.POLLIN)
        into.append(sock)

    bind(pub_path, zmq.XPUB, pubs)
    bind(replay_path, zmq.ROUTER, routers)
    say("ready")
    deadline = time.monotonic() + seconds
    next_publish = 0.0
    while time.monotonic() < deadline:
        bind(pub_path, zmq.XPUB, pubs)
        bind(replay_path, zmq.ROUTER, routers)
        for sock, _ in poller.poll(2):
            frames = sock.recv_multipart()
            if sock.socket_type == zmq.XPUB:
                if frames[0][:1] == b"\x01":
                    subscriptions += 1
                    say("subscribed")
            else:
                replays += 1
                say("replay")
                sock.send_multipart([frames[0], *replay_end_frames()])
        if time.monotonic() >= next_publish:
            payload = encode_batch(time.time(), [event], None)
            for sock in pubs:
                sock.send_multipart(encode_frames(TOPIC, seq, payload))
            seq += 1
            next_publish = time.monotonic() + 0.02
    say(json.dumps({"subscriptions": subscriptions, "replays": replays}))
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), [int(h) for h in sys.argv[3:]])
