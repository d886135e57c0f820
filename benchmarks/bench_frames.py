"""CPU per peer frame: the daemon's peer path against the floor of trio itself.

Every figure of the daemon's cost (idle heartbeats, CPU per convergence, latency on a
shared machine) is frames times the CPU one frame costs. This measures that cost
where nothing else runs, in one process, with ``time.process_time``:

* **floor**: two trio tasks echo a 120-byte message over a loopback TCP connection:
  one ``send_all`` and one ``receive_some`` per message and side, nothing else;
* **peer path**: two `PeerHub`s (the daemon's own sessions, links, gate and
  telemetry) over a loopback TCP connection, no TLS, no log, converging on one
  two-member stream: each round both nodes commit the next epoch and wait until both
  hold it as their restore point. Every frame is encoded, sent, received, decoded and
  merged, and each record refreshes the agreement, as in a daemon; the link timer
  ticks once a second, so heartbeats are not part of it.

Both run in one process, so each figure is the CPU of both ends of a frame. The ratio
is what the daemon's Python adds to a frame over trio's own socket path. Runs are
interleaved and the medians reported; ``--quick`` runs a short smoke.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench_daemon import machine  # noqa: E402
from report import command_line, write_fragment  # noqa: E402

from convergenced.core.facts import Commit, Declare  # noqa: E402
from convergenced.core.gate import OutputGate  # noqa: E402
from convergenced.core.link import LinkConfig, Role  # noqa: E402
from convergenced.core.node import NodeCore  # noqa: E402
from convergenced.core.spec import Policy, StreamSpec  # noqa: E402
from convergenced.daemon.peers.session import PeerHub, PeerSession  # noqa: E402
from convergenced.daemon.telemetry import Telemetry  # noqa: E402

MESSAGE = b"x" * 120


async def floor_run(seconds: float) -> tuple[int, float]:
    """Messages echoed and process CPU seconds over ``seconds`` of plain trio TCP."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    count = 0

    async def echo(stream: trio.SocketStream) -> None:
        while data := await stream.receive_some(65536):
            await stream.send_all(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, echo, listeners)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        cpu0, deadline = time.process_time(), trio.current_time() + seconds
        while trio.current_time() < deadline:
            await client.send_all(MESSAGE)
            await client.receive_some(65536)
            count += 2  # one message each way
        cpu = time.process_time() - cpu0
        await client.aclose()
        nursery.cancel_scope.cancel()
    return count, cpu


SPEC = StreamSpec.create("bench", {"a": [0], "b": [1]}, Policy.all_of("nvme"))


def _hub(name: str) -> PeerHub:
    node = NodeCore(name, 1)
    gate = OutputGate(node)
    gate.apply(Declare(SPEC))

    async def durable(position: int) -> None:  # no log: this measures the peer path
        gate.synced(gate.take_unlogged()[1])

    config = LinkConfig(cluster="bench", idle_ticks=5, dead_ticks=10_000)
    return PeerHub(node, gate, durable, config, Telemetry(), tick_seconds=1.0)


async def peer_run(seconds: float) -> tuple[int, float]:
    """Frames and process CPU seconds over ``seconds`` of two hubs converging."""
    a, b = _hub("a"), _hub("b")
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def accept(stream: trio.SocketStream) -> None:
        await PeerSession(b, stream, Role.ACCEPTOR).run()

    async def converge(epoch: int) -> None:
        for rank, hub in enumerate((a, b)):
            hub.gate.apply(Commit("bench", rank, "nvme", epoch))
            hub.view_changed()
        while not all(h.node.restore_point("bench") == epoch for h in (a, b)):
            await a.wait_changed()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, accept, listeners)
        nursery.start_soon(a.run_timer)
        nursery.start_soon(b.run_timer)
        ours = PeerSession(a, await trio.open_tcp_stream("127.0.0.1", port), Role.INITIATOR)
        nursery.start_soon(ours.run)
        while ours.peer is None:
            await trio.sleep(0.01)
        epoch = 0
        for epoch in range(1, 11):  # warm up
            await converge(epoch)
        link = ours.link
        frames0, cpu0 = link.frames_sent + link.frames_received, time.process_time()
        deadline = trio.current_time() + seconds
        while trio.current_time() < deadline:
            epoch += 1
            await converge(epoch)
        cpu = time.process_time() - cpu0
        frames = link.frames_sent + link.frames_received - frames0
        nursery.cancel_scope.cancel()
    return frames, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--out", type=Path, metavar="DIR", help="also write DIR/frames.md")
    parser.add_argument("--runs", type=int, default=None, help="runs of each (default 5)")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 5)
    seconds = 0.5 if args.quick else 3.0
    info = machine()
    import logging

    logging.disable(logging.INFO)  # the links' up/down lines
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    floor_us: list[float] = []
    peer_us: list[float] = []
    for _ in range(runs):  # interleaved, so drifting load hits both alike
        n, cpu = trio.run(floor_run, seconds)
        floor_us.append(cpu / n * 1e6)
        n, cpu = trio.run(peer_run, seconds)
        peer_us.append(cpu / n * 1e6)
    floor, peer = statistics.median(floor_us), statistics.median(peer_us)
    table = "\n".join(
        [
            f"{'path':<44}{'CPU per frame p50':>18}{'runs':>8}",
            "-" * 70,
            f"{'floor: trio TCP echo, 120 B':<44}{floor:>15.0f} us{runs:>8}",
            f"{'peer path: two PeerHubs converging, no TLS':<44}{peer:>15.0f} us{runs:>8}",
            "",
            f"peer path / floor = {peer / floor:.1f}: what the daemon's Python adds per frame",
            "both ends of every frame run in this one process (CPU = time.process_time);",
            f"each run {seconds:g} s; per run (us): floor "
            + "/".join(f"{x:.0f}" for x in floor_us)
            + ", peer "
            + "/".join(f"{x:.0f}" for x in peer_us),
        ]
    )
    print(table)
    if args.out:
        cmd = command_line(__file__, sys.argv[1:] if argv is None else argv)
        write_fragment(args.out, "frames", cmd, info, table)
    if args.json:
        data: dict[str, Any] = {
            "machine": info,
            "floor_us": floor,
            "peer_us": peer,
            "ratio": peer / floor,
            "runs": {"floor_us": floor_us, "peer_us": peer_us},
        }
        print(json.dumps(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
