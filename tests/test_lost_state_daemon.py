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
from pathlib import Path
from typing import Any

from daemons import LocalCluster, until

from convergenced.integrations.files import CheckpointStore, Tier


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


def test_the_files_integration_commits_again_what_a_wiped_node_still_holds(
    tmp_path: Path,
) -> None:
    """As above, but nobody commits by hand: each rank's `CheckpointStore` keeps
    training through the wipe, its client reconnects to the new life of node 3 (and
    declares again), and the store commits again the shards node 3's disk still holds,
    without reading them again (it wrote them). A new generation resolves at the epoch
    they hold, and every store restores it."""
    with LocalCluster(3) as cluster:
        cluster.start_all()
        clients = [cluster.client(i, reconnect=30) for i in (1, 2, 3)]
        stores = []
        for rank, c in enumerate(clients):
            c.declare(cluster.spec(retention=1))
            stores.append(CheckpointStore(c, "job", rank, Tier("nvme", tmp_path / f"nvme-{rank}")))
        for e in range(1, 6):
            for rank, store in enumerate(stores):
                store.save(e, payload(rank, e))
        until(lambda: _all_at(clients, 5), what="restore point 5 everywhere")
        assert {a["restore_point"] for a in _generation(clients, 1)} == {5}

        cluster.kill(3)
        shutil.rmtree(cluster.dir / cluster.name(3) / "state")
        cluster.start(3)
        # The first call after the restart goes through the reconnect: the client
        # declares again, then the store's hook commits again epochs 1 to 5.
        until(lambda: _all_at(clients, 5), timeout=30, what="the same restore point again")
        again = stores[2].recommitted
        assert again is not None
        assert again.committed == [("nvme", e) for e in range(1, 6)] and again.read == []
        assert clients[2].status()["counters"].get("state_losses") == 1

        restored: list[Any] = [None] * 3

        def restore(rank: int) -> None:
            restored[rank] = stores[rank].restore(2, timeout=30)

        threads = [threading.Thread(target=restore, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert restored == [(5, payload(rank, 5)) for rank in range(3)]
        for store in stores:
            store.close()


def payload(rank: int, epoch: int) -> bytes:
    return f"rank {rank} epoch {epoch}".encode()
