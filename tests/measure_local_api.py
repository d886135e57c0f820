"""Measures what hostile or numerous local clients cost a real daemon's commits.

Not a test (nothing here asserts a duration): the figures behind the local API's
robustness work, reproducible with::

    .venv/bin/python tests/measure_local_api.py flood [--payload not-a-map]
    .venv/bin/python tests/measure_local_api.py watchers [--watches 2048]

``flood``: eight connections each send six frames of about 960 KiB while a
well-behaved client commits, one commit at a time; prints the commits' latency
before and during the flood. Payloads: ``not-a-map`` (an array of a million empty
maps), ``maps-in-a-request`` (the same inside a request map), ``within-budget`` (a
request map holding as many maps and objects as a request may, padded with a
string), ``big-string`` (a request map padded with a 960 KiB string).

``watchers``: opens that many watches of one stream (256 per connection, events
read as they come) and prints the latency of commits to that stream with and
without them.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from daemons import LocalCluster

from convergenced.core import local_api_codec as codec

EMPTY_MAPS = b"\x9f" + (b"\xdc\xff\xff" + b"\x80" * 0xFFFF) * 15


def payload(kind: str) -> bytes:
    if kind == "not-a-map":
        body = EMPTY_MAPS
    elif kind == "maps-in-a-request":
        body = b"\x83\xa2id\x01\xa2op\xa6status\xa4args\x81\xa1x" + EMPTY_MAPS
    elif kind == "within-budget":  # as costly as a request may be: 8,000 maps, 65,000 ints
        head = b"\x83\xa2id\x01\xa2op\xa6status\xa4args\x83"
        body = head + b"\xa1x\xdc" + struct.pack(">H", 8000) + b"\x80" * 8000
        body += b"\xa1y\xdc" + struct.pack(">H", 65000) + b"\x01" * 65000
        pad = (960 << 10) - len(body) - 9
        body += b"\xa3pad\xdb" + struct.pack(">I", pad) + b"x" * pad
    else:
        pad = 960 << 10
        body = b"\x83\xa2id\x01\xa2op\xa6status\xa4args\x81\xa3pad\xdb"
        body += struct.pack(">I", pad) + b"x" * pad
    return codec.LENGTH.pack(len(body)) + body


def latencies(commit: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        commit()  # type: ignore[operator]
        out.append(time.perf_counter() - started)
    return out


def summary(name: str, xs: list[float]) -> None:
    ms = sorted(x * 1000 for x in xs)
    print(
        f"{name:>28}: n={len(ms)} median {statistics.median(ms):7.1f} ms  "
        f"p90 {ms[int(0.9 * (len(ms) - 1))]:7.1f} ms  max {ms[-1]:7.1f} ms"
    )


def flood(cluster: LocalCluster, kind: str, connections: int, frames: int) -> None:
    client = cluster.client(1)
    LocalCluster.declare_solo(client, "job", "nvme")
    epoch = iter(range(1, 10**9))

    def commit() -> None:
        client.commit("job", rank=0, domain="nvme", epoch=next(epoch))

    summary("commit, quiet", latencies(commit, 50))
    data = payload(kind) * frames
    done = threading.Event()

    def flooder() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(cluster.socket_path(1)))
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            except OSError as exc:
                print(f"flooder: {exc}")  # the daemon hung up on a frame it refuses

    threads = [threading.Thread(target=flooder) for _ in range(connections)]
    during: list[float] = []
    for t in threads:
        t.start()

    def watcher() -> None:
        for t in threads:
            t.join()
        done.set()

    threading.Thread(target=watcher).start()
    started = time.perf_counter()
    while not done.is_set():
        during += latencies(commit, 1)
    print(f"flood of {connections} x {frames} frames ({kind}) lasted "
          f"{time.perf_counter() - started:.2f} s")  # fmt: skip
    summary("commit, during the flood", during)


def watchers(cluster: LocalCluster, watches: int) -> None:
    client = cluster.client(1)
    LocalCluster.declare_solo(client, "job", "nvme")
    epoch = iter(range(1, 10**9))

    def commit() -> None:
        client.commit("job", rank=0, domain="nvme", epoch=next(epoch))

    summary("commit, no watch", latencies(commit, 100))
    socks = []
    events = [0]
    lock = threading.Lock()

    def drain(s: socket.socket) -> None:
        reader = codec.FrameReader(64 << 20)
        try:
            while data := s.recv(1 << 20):
                n = len(reader.feed(data))
                with lock:
                    events[0] += n
        except OSError:
            pass

    per = 256
    for first in range(0, watches, per):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(cluster.socket_path(1)))
        n = min(per, watches - first)
        s.sendall(b"".join(
            codec.encode_frame(codec.request(first + i + 1, "watch", stream="job"))
            for i in range(n)
        ))  # fmt: skip
        threading.Thread(target=drain, args=(s,), daemon=True).start()
        socks.append(s)
    deadline = time.monotonic() + 60
    while events[0] < watches and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"{watches} watches open ({events[0]} first events)")
    summary(f"commit, {watches} watches", latencies(commit, 100))
    for s in socks:
        s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    f = sub.add_parser("flood")
    f.add_argument("--payload", default="not-a-map",
                   choices=["not-a-map", "maps-in-a-request", "within-budget",
                            "big-string"])  # fmt: skip
    f.add_argument("--connections", type=int, default=8)
    f.add_argument("--frames", type=int, default=6)
    w = sub.add_parser("watchers")
    w.add_argument("--watches", type=int, default=2048)
    args = parser.parse_args(argv)
    with LocalCluster(1) as cluster:
        cluster.start_all()
        if args.what == "flood":
            flood(cluster, args.payload, args.connections, args.frames)
        else:
            watchers(cluster, args.watches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
