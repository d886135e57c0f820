"""A fleet moves from trust lists to CA-bound trust without downtime (docs/bare-metal.md,
"Migrating from trust lists"), with real daemons.

Six daemons with per-node files (`[[peers]]` and a `[trust]` list each) and a mesh
limit of 2, so each links to four others and the records of the fifth are relayed:
checked against a key from the receiver's trust list or from the origin's credential.
Each daemon in turn gets ``trust_mode = "ca"`` and is restarted, and the mixed fleet
agrees on a new epoch after every step; then every file drops its trust list and is
reloaded with SIGHUP, and the fleet agrees again on credentials alone.
"""

from __future__ import annotations

import re
import signal
from typing import Any

from daemons import LocalCluster, until

N = 6


def agree(cluster: LocalCluster, spec: dict[str, Any], epoch: int) -> None:
    """Every rank commits ``epoch``; every node sees it as the restore point."""
    for i in range(1, N + 1):
        cluster.client(i).commit(spec["name"], i - 1, "nvme", epoch)
    for i in range(1, N + 1):
        state = cluster.client(i).wait(spec["name"], epoch, timeout=30)
        assert state["restore_point"] == epoch, (i, state)


def test_a_fleet_moves_from_trust_lists_to_the_ca_without_downtime() -> None:
    with LocalCluster(N, extra="mesh_limit = 2") as cluster:
        cluster.start_all()
        spec = cluster.spec("job")
        for i in range(1, N + 1):
            cluster.client(i).declare(spec)
        agree(cluster, spec, 1)
        epoch = 1
        for i in range(1, N + 1):  # step 2: CA mode, one host at a time
            path = cluster.configs[i - 1]
            path.write_text(path.read_text().replace("\n[tls]", '\ntrust_mode = "ca"\n\n[tls]'))
            assert cluster.kill(i, signal.SIGTERM) == 0
            cluster.start(i)
            epoch += 1
            agree(cluster, spec, epoch)  # the mixed fleet agrees after every step
        for i in range(1, N + 1):  # step 3: no more lists
            path = cluster.configs[i - 1]
            path.write_text(re.sub(r"\n\[trust\]\n(\"[^\n]*\n)+", "\n", path.read_text()))
            assert "[trust]" not in path.read_text()
            cluster.procs[i].send_signal(signal.SIGHUP)
        for i in range(1, N + 1):
            until(lambda i=i: "configuration reloaded" in cluster.log(i), 20, "the reload")
        epoch += 1
        agree(cluster, spec, epoch)  # node-1 and node-4 are not linked: relayed records
        for i in range(1, N + 1):
            status = cluster.client(i).status()
            assert status["fleet"]["trust_mode"] == "ca"
            assert set(status["fleet"]["credentials"]) == {cluster.name(j) for j in range(1, N + 1)}
