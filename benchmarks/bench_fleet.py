"""A fleet of real daemons from one shared configuration, at 32 nodes by default.

Starts N daemons on loopback (`tests/fleet_cluster.py`): no node id, peer list or
trust list in their shared configuration; peers from the SRV records of a real DNS
server, record keys from credentials the cluster CA vouches for. Measures, in one
run: how long until every node knows every other and holds a link to each of its
overlay peers; how long until all N agree on a restore point; then, after two hosts
are replaced by spares with new identities at the same addresses, how long until
the fleet is whole again and agrees with them as members. Also the daemons' CPU
(user + system, from /proc) over each phase. ``--quick`` runs 4 nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO, REPO / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_daemon import machine  # noqa: E402
from fleet_cluster import FleetCluster  # noqa: E402
from report import command_line, write_fragment  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(fleet: FleetCluster) -> float:
    """User plus system CPU of every running daemon so far."""
    total = 0
    for proc in fleet.procs.values():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


def agree(fleet: FleetCluster, stream: str, nodes: list[str], epoch: int) -> None:
    members = {node: [i] for i, node in enumerate(nodes)}
    spec = {"name": stream, "members": members, "policy": {"mode": "all", "domains": ["nvme"]}}
    for i, node in enumerate(nodes):
        c = fleet.client(node)
        c.declare(spec)
        c.commit(stream, i, "nvme", epoch)
    for node in nodes:
        state = fleet.client(node).wait(stream, epoch, timeout=300)
        assert state["restore_point"] == epoch, (node, state)


def phase(fleet: FleetCluster, what: str, fn: Any, out: dict[str, Any]) -> None:
    cpu, start = cpu_seconds(fleet), time.monotonic()
    fn()
    out[what] = {"seconds": round(time.monotonic() - start, 1),
                 "daemon_cpu_s": round(cpu_seconds(fleet) - cpu, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=32, help="fleet size (default 32)")
    parser.add_argument("--quick", action="store_true", help="4 nodes, for a smoke run")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument("--out", type=Path, metavar="DIR", help="also write DIR/fleet.md")
    args = parser.parse_args(argv)
    n = 4 if args.quick else args.nodes
    info = machine()
    names = [f"fleet-{i:02d}" for i in range(1, n + 1)]
    spares = [f"fleet-{i:02d}" for i in range(n + 1, n + 3)]
    results: dict[str, Any] = {}
    limit = 60 + 10 * n
    with FleetCluster(fast=False) as fleet:  # the daemon's own link timer
        for node in names:
            fleet.add(node)

        def start() -> None:
            for node in names:
                fleet.start(node)
            fleet.wait_whole(names, limit, "the fleet whole")

        phase(fleet, "links up", start, results)
        phase(fleet, "agreed", lambda: agree(fleet, "job", names, 5), results)
        now = names[:-2] + spares

        def replace() -> None:
            for old, new in zip(names[-2:], spares, strict=True):
                port = fleet.ports[old]
                fleet.remove(old)
                fleet.add(new, port)
                fleet.start(new)
            fleet.wait_whole(now, limit, "the spares in the fleet")

        phase(fleet, "spares linked", replace, results)
        phase(fleet, "agreed again", lambda: agree(fleet, "job2", now, 7), results)
        refused = 0
        for node in now:
            status = fleet.status(node) or {"counters": {}}
            refused += sum(v for k, v in status["counters"].items()
                           if k.startswith("credentials_refused"))  # fmt: skip
    lines = [
        f"{n} daemons on loopback, one shared configuration, peers from DNS SRV, "
        "trust from the cluster CA",
        f"{'phase':<16} {'wall s':>7} {'daemon CPU s':>13} {'per node ms':>12}",
    ]
    for what, r in results.items():
        per = 1000 * r["daemon_cpu_s"] / n
        lines.append(f"{what:<16} {r['seconds']:>7.1f} {r['daemon_cpu_s']:>13.1f} {per:>12.0f}")
    lines += [
        "",
        "links up: from the first start until every node knows all others and holds a "
        "link to each of its overlay peers",
        "agreed: every member declared a stream of all nodes, committed, and saw the restore point",
        "spares linked: two hosts replaced by spares with new identities at the same "
        "addresses, until the fleet is whole again",
        f"credentials refused: {refused}",
    ]
    body = "\n".join(lines)
    print(body)
    if args.out:
        cmd = command_line(__file__, sys.argv[1:] if argv is None else argv)
        write_fragment(args.out, "fleet", cmd, info, body)
    if args.json:
        print(json.dumps({"nodes": n, "phases": results, "refused": refused}, sort_keys=True))
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
