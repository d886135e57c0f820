"""The files integration across a change of membership, against real daemons: a spare
takes over the rank of a host that died for good, from the shared tier (adoption), a
job shrinks onto fewer hosts, a relaunch on the same hosts keeps its membership, and
a relaunch heals a launch that died half way through declaring a new map.

Every launch goes through `CheckpointStore` given the stream's spec and a `Launch`
(one rank asks `new_launch`, the others get it handed): the store declares the spec
for the launch and commits what its tiers hold before the ranks restore.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.client import ApiError, Client
from convergenced.integrations.files import (
    CheckpointError,
    CheckpointStore,
    Launch,
    NoRestorePointError,
    Restored,
    Tier,
)
from convergenced.integrations.launches import new_launch, solo_launch

STREAM = "moving"
FIRST = {"node-1": [0], "node-2": [1], "node-3": [2]}
SPARE = {"node-1": [0], "node-2": [1], "node-4": [2]}  # node-4 replaces node-3
SHRUNK = {"node-1": [0, 2], "node-2": [1]}  # node-1 takes node-3's rank over


def spec(members: Mapping[str, list[int]], retention: int = 0) -> dict[str, Any]:
    return {
        "name": STREAM,
        "members": dict(members),
        "policy": {"mode": "any", "domains": ["nvme", "s3"]},
        "retention": retention,
        "shared": ["s3"],  # the object store: readable from any host
    }


def payload(rank: int, epoch: int) -> dict[str, bytes]:
    return {"weights": f"rank {rank} after step {epoch}".encode()}


class Job:
    """The tiers of a job on one machine: a local one per host, one shared by all."""

    def __init__(self, cluster: LocalCluster, tmp: Path) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.shared = Tier("s3", tmp / "bucket")
        self.clients: dict[int, Client] = {}

    def local(self, node: int) -> Tier:
        return Tier("nvme", self.tmp / f"node-{node}-nvme")

    def client(self, node: int) -> Client:
        if node not in self.clients:
            self.clients[node] = self.cluster.client(node)
        return self.clients[node]

    def open(
        self,
        members: Mapping[str, list[int]],
        launch: Launch,
        delay: Callable[[int, int], float] = lambda rank, epoch: 0.0,
    ) -> dict[int, CheckpointStore]:
        """Every rank's store for ``launch`` (rank -> store), on its host of ``members``."""
        stores = {}
        for node_id, ranks in sorted(members.items()):
            node = int(node_id.removeprefix("node-"))
            for rank in ranks:
                stores[rank] = CheckpointStore(
                    self.client(node), spec(members), rank, self.local(node), self.shared,
                    launch=launch, upload_delay=lambda e, r=rank: delay(r, e),
                )  # fmt: skip
        return stores

    def saved(self, stores: Mapping[int, CheckpointStore], epochs: Sequence[int]) -> None:
        for epoch in epochs:
            for rank, store in stores.items():
                store.save(epoch, payload(rank, epoch))


def started(cluster: LocalCluster, nodes: Sequence[int]) -> None:
    """Start ``nodes`` and wait until each has heard from the others (a daemon that
    started without a log answers next_generation for a stream it has not declared
    only once it has heard from every peer it links to)."""
    for i in nodes:
        cluster.start(i, wait=False)
    for i in nodes:
        cluster.wait_ready(i)
    want = f"{len(nodes) - 1}/"
    for i in nodes:
        c = cluster.client(i)
        until(lambda c=c: c.status()["summary"].startswith(want), what="the links")
        c.close()


def restore_all(stores: Mapping[int, CheckpointStore]) -> dict[int, Restored]:
    """Every rank restores at once (each waits until every member asked)."""
    with ThreadPoolExecutor(len(stores)) as pool:
        futures = {r: pool.submit(s.restore, None, 30) for r, s in stores.items()}
        return {r: f.result() for r, f in futures.items()}


def close_all(stores: Mapping[int, CheckpointStore]) -> None:
    for store in stores.values():
        store.close()


def shards(tier: Tier, rank: int) -> list[int]:
    base = tier.directory / STREAM
    return sorted(int(p.parent.name.removeprefix("epoch-")) for p in base.glob(f"*/rank-{rank}.*"))


def test_a_spare_takes_over_the_rank_of_a_dead_host_from_the_shared_tier(tmp_path: Path) -> None:
    with LocalCluster(4) as cluster:
        started(cluster, [1, 2, 3, 4])  # node-4: a spare, running, hosting no rank
        job = Job(cluster, tmp_path)
        first = new_launch(job.client(1), spec(FIRST))
        assert first == Launch(0, 0)  # nobody knows the stream yet: a plain declaration
        # node-3's upload of epoch 4 is still on its way when its host dies.
        stores = job.open(FIRST, first, lambda rank, epoch: 3600.0 if (rank, epoch) == (2, 4)
                          else 0.0)  # fmt: skip
        job.saved(stores, [1, 2, 3, 4])
        stores[0].flush(10)
        stores[1].flush(10)
        until(lambda: stores[2].uploaded == [1, 2, 3], what="rank 2's uploads of 1-3")
        for c in (job.client(i) for i in (1, 2, 3)):
            until(lambda c=c: c.state(STREAM)["gc_horizon"] == 3, what="the horizons")
        for store in stores.values():
            store.gc()
        # The portable cap: the newest epoch node-3 holds in the shared tier (3) stays
        # everywhere, although every member has 4 on nvme (the plain horizon is 4).
        assert shards(job.shared, 2) == [3]
        assert shards(job.local(1), 0) == [3, 4] and shards(job.local(3), 2) == [3, 4]

        # node-3 dies for good: its trainer, its daemon and its state directory. Its
        # nvme directory stays on this machine's disk: nothing may read it any more.
        job.client(3).close()
        stores[2].close(flush=False)
        close_all({r: s for r, s in stores.items() if r != 2})
        cluster.kill(3)
        shutil.rmtree(cluster.dir / "node-3" / "state")
        spare = job.client(4)
        # The spare answers next_generation before it has declared the stream.
        until(lambda: spare.next_generation(STREAM, timeout=10)["generation"] == 1,
              what="the spare's next generation")  # fmt: skip
        second = new_launch(job.client(1), spec(SPARE))
        assert second == Launch(1, 1)  # a new member map, from generation 1 on
        stores = job.open(SPARE, second)
        assert stores[2].recommitted is not None
        assert stores[2].recommitted.committed == [("s3", 3)]  # adopted from the shared tier
        assert spare.state(STREAM)["newest"]["node-4"] == {"s3": 3}  # no nvme of node-3's
        assert spare.state(STREAM)["spec"]["membership"] == 1

        restored = restore_all(stores)
        assert restored == {r: Restored(3, payload(r, 3)) for r in range(3)}
        assert stores[2].read(3, retract=False).domain == "s3"
        job.saved(stores, [4, 5])
        for i in (1, 2, 4):
            assert job.client(i).wait(STREAM, 5, timeout=20)["restore_point"] == 5
        assert shards(job.local(4), 2) == [4, 5]
        close_all(stores)


def test_a_job_that_shrinks_restores_the_moved_rank_from_the_shared_tier(
    tmp_path: Path,
) -> None:
    with LocalCluster(3) as cluster:
        started(cluster, [1, 2, 3])
        job = Job(cluster, tmp_path)
        late = lambda rank, epoch: 3600.0 if epoch == 3 else 0.0  # noqa: E731
        stores = job.open(FIRST, new_launch(job.client(1), spec(FIRST)), late)
        job.saved(stores, [1, 2])
        for store in stores.values():
            store.flush(10)
        stores[2].save(3, payload(2, 3))  # on node-3's nvme only: lost with its host
        stores.pop(2).close(flush=False)
        close_all(stores)
        cluster.kill(3)
        launch = new_launch(job.client(1), spec(SHRUNK))
        assert launch.membership == launch.generation > 0
        # Two ranks on node-1 share its nvme directory: each finds only its own shards.
        stores = job.open(SHRUNK, launch)
        assert stores[2].recommitted is not None
        assert stores[2].recommitted.committed == [("s3", 1), ("s3", 2)]
        assert restore_all(stores) == {r: Restored(2, payload(r, 2)) for r in range(3)}
        close_all(stores)


def test_a_relaunch_on_the_same_hosts_keeps_its_membership(tmp_path: Path) -> None:
    with LocalCluster(2) as cluster:
        started(cluster, [1, 2])
        job = Job(cluster, tmp_path)
        members = {"node-1": [0], "node-2": [1]}
        stores = job.open(members, new_launch(job.client(1), spec(members)))
        declared = job.client(2).state(STREAM)["spec"]
        job.saved(stores, [1, 2])
        close_all(stores)
        for expected in (Launch(1, 0), Launch(2, 0)):
            launch = new_launch(job.client(2), spec(members))
            assert launch == expected  # the same map: no new membership, no rollback
            stores = job.open(members, launch)
            assert restore_all(stores) == {r: Restored(2, payload(r, 2)) for r in range(2)}
            close_all(stores)
        assert job.client(1).state(STREAM)["spec"] == declared


def test_a_relaunch_heals_a_launch_that_died_declaring_a_new_map(tmp_path: Path) -> None:
    with LocalCluster(3) as cluster:
        started(cluster, [1, 2, 3])
        job = Job(cluster, tmp_path)
        members = {"node-1": [0], "node-2": [1]}
        stores = job.open(members, new_launch(job.client(1), spec(members)))
        job.saved(stores, [1, 2])
        close_all(stores)
        # A launch onto three hosts declared its map on node-2, then died.
        cluster.kill(3)
        grown = {**members, "node-3": [2]}
        job.client(2).declare(Launch(1, 1).spec(spec(grown)))
        until(lambda: job.client(1).next_generation(STREAM)["generation"] == 2,
              what="node-1 hearing of membership 1")  # fmt: skip
        # The next launch runs on the first two hosts again. Their map is the one node-1
        # holds, but node-2 moved on: keeping membership 0 would be refused there.
        launch = new_launch(job.client(1), spec(members))
        assert launch == Launch(2, 2)
        stores = job.open(members, launch)
        assert restore_all(stores) == {r: Restored(2, payload(r, 2)) for r in range(2)}
        close_all(stores)


def test_a_stream_of_one_rank_opens_its_own_launch_on_a_daemon_without_peers(
    tmp_path: Path,
) -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        job = Job(cluster, tmp_path)
        solo = {"node-1": [0]}
        with CheckpointStore(job.client(1), spec(solo), 0, job.local(1), job.shared) as store:
            assert store.launch == Launch(1, 0)
            with pytest.raises(NoRestorePointError):
                store.restore(timeout=10)
            store.save(1, payload(0, 1))
        with CheckpointStore(job.client(1), spec(solo), 0, job.local(1), job.shared) as store:
            assert store.launch == Launch(2, 0)
            assert store.restore(timeout=10) == Restored(1, payload(0, 1))


def test_launches_are_checked_before_anything_is_declared(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="membership 3 above generation 2"):
        Launch(2, 3)
    with pytest.raises(ValueError, match="non-negative"):
        Launch(-1, 0)
    assert Launch(5, 5).spec(spec(FIRST)).membership == 5
    with LocalCluster(1) as cluster:
        cluster.start_all()
        client = cluster.client(1)
        local = Tier("nvme", tmp_path / "nvme")
        with pytest.raises(CheckpointError, match="3 ranks"):
            solo_launch(client, spec(FIRST))
        with pytest.raises(CheckpointError, match="3 ranks"):
            CheckpointStore(client, spec(FIRST), 0, local)
        with pytest.raises(ValueError, match="launch= needs the stream's spec"):
            CheckpointStore(client, STREAM, 0, local, launch=Launch(0, 0))
        with pytest.raises(ApiError) as info:
            client.state(STREAM)
        assert info.value.reason == "unknown_stream"  # nothing was declared
