"""Real daemons: a node whose state directory is wiped comes back honest and in step.

Three secure daemons on loopback agree on a restore point and a recovery generation.
Node 3 is killed and its state directory removed (its identity key and the
incarnation floor beside it survive, as they live outside it); it restarts, its rank
commits again what it still holds. Every node reports the same restore point again,
node 3 answers the old generation as before (it adopted its frozen set), a new
generation resolves everywhere, node 3's incarnation went up, not back to 1, and the
loss shows in its log and counters.
"""

from __future__ import annotations

import shutil
import threading
from typing import Any

from daemons import LocalCluster, until


def _all_at(clients: list[Any], epoch: int) -> bool:
    return all(c.state("job")["restore_point"] == epoch for c in clients)


def _generation(clients: list[Any], g: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{}] * len(clients)

    def ask(i: int) -> None:
        out[i] = clients[i].restore_point("job", g, timeout=30)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_wiped_state_directory_comes_back_in_step_within_30_seconds() -> None:
    with LocalCluster(3) as cluster:
        cluster.start_all()
        clients = [cluster.client(i) for i in (1, 2, 3)]
        for c in clients:
            c.declare(cluster.spec(retention=1))
        for e in range(1, 6):
            for rank, c in enumerate(clients):
                c.commit("job", rank, "nvme", e)
        until(lambda: _all_at(clients, 5), what="restore point 5 everywhere")
        first = _generation(clients, 1)
        assert {a["restore_point"] for a in first} == {5}
        before = clients[2].status()["incarnation"]

        cluster.kill(3)
        shutil.rmtree(cluster.dir / cluster.name(3) / "state")  # the key lives beside it
        cluster.start(3)
        again = cluster.client(3)
        again.declare(cluster.spec(retention=1))
        for e in (4, 5):  # what its files integration would find and commit again
            again.commit("job", 2, "nvme", e)
        clients[2] = again

        until(lambda: _all_at(clients, 5), timeout=30, what="the same restore point again")
        status = again.status()
        assert status["incarnation"] > before
        assert status["counters"].get("state_losses") == 1
        assert "this node's state was lost" in cluster.log(3)
        assert again.restore_point("job", 1, timeout=30)["restore_point"] == 5
        for e in (6, 7):
            for rank, c in enumerate(clients):
                c.commit("job", rank, "nvme", e)
        second = _generation(clients, 2)
        assert {a["restore_point"] for a in second} == {7}
