"""CheckpointStore with an S3 bucket as its shared tier (`ObjectTier`), against real
daemons and a real S3 API server (tests/s3server.py): uploads committed and restored,
a large shard in parts, a failed upload committing nothing, a corrupted object
retracted on restore, a spare adopting a dead host's rank from the bucket, and gc
deleting from the bucket only what the daemon says is safe."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster, until
from s3server import S3Bucket, require_s3fs

from convergenced.client import ApiError, Client
from convergenced.integrations.files import (
    CheckpointStore,
    Launch,
    Restored,
    ShardUnavailableError,
    Tier,
    UploadError,
)
from convergenced.integrations.launches import new_launch
from convergenced.integrations.objectstore import MIN_PART_SIZE, ObjectTier


@pytest.fixture(autouse=True)
def _s3fs() -> None:
    require_s3fs()


@pytest.fixture(scope="module")
def solo() -> Iterator[LocalCluster]:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        yield cluster


@pytest.fixture
def client(solo: LocalCluster) -> Client:
    return solo.client(1)


def _eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)
    return value


def tiers(tmp_path: Path, bucket: S3Bucket) -> tuple[Tier, ObjectTier]:
    return Tier("nvme", tmp_path / "nvme"), ObjectTier(
        "s3", f"{bucket.url}/ckpt", part_size=MIN_PART_SIZE
    )


def test_uploads_are_committed_and_restored_from_the_bucket(
    client: Client, tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    stream = LocalCluster.declare_solo(client, "s3-roundtrip", "nvme", "s3", mode="any")
    local, remote = tiers(tmp_path, s3_bucket)
    big = {"weights": os.urandom(2 * MIN_PART_SIZE), "step": b"2"}  # three parts
    with CheckpointStore(client, stream, 0, local, remote) as store:
        store.save(1, b"one")
        store.save(2, big)
        store.flush(timeout=30)
        assert store.uploaded == [1, 2]
        assert client.state(stream)["newest"]["node-1"] == {"nvme": 2, "s3": 2}
        head = s3_bucket.client.head_object(Bucket=s3_bucket.name, Key=remote.key(stream, 2, 0))
        assert head["ETag"].endswith('-3"')
        shutil.rmtree(local.directory)  # the host's disk is gone: the bucket has it all
        shard = store.read(2)
        assert (shard.domain, shard.payload, shard.path) == ("s3", big, remote.locate(stream, 2, 0))
        assert store.restore(1, timeout=20) == Restored(2, big)


def test_a_failed_upload_commits_nothing_and_leaves_no_object(
    client: Client, tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    stream = LocalCluster.declare_solo(client, "s3-failed", "nvme", "s3", mode="any")
    local, remote = tiers(tmp_path, s3_bucket)
    with CheckpointStore(client, stream, 0, local, remote) as store:
        store.save(1, b"one")
        store.flush(timeout=20)
        # Epoch 2's upload: the server refuses its second part; epoch 3's completion.
        s3_bucket.server.fail("PUT", path="epoch-2/", query="partNumber", after=1)
        s3_bucket.server.fail("POST", path="epoch-3/", query="uploadId")
        store.save(2, os.urandom(2 * MIN_PART_SIZE))
        store.save(3, os.urandom(2 * MIN_PART_SIZE))
        with pytest.raises(UploadError) as failed:
            store.flush(timeout=30)
        assert [epoch for epoch, _ in failed.value.failures] == [2, 3]
        assert [r["hits"] for r in s3_bucket.server.faults()] == [1, 1]
        assert store.uploaded == [1] and store.epochs(remote) == [1]
        assert client.state(stream)["newest"]["node-1"] == {"nvme": 3, "s3": 1}
        assert s3_bucket.keys() == [remote.key(stream, 1, 0)] and s3_bucket.uploads() == []
        s3_bucket.server.clear_faults()
        store.save(4, b"four")  # the next upload goes through
        store.flush(timeout=20)
        assert client.state(stream)["newest"]["node-1"] == {"nvme": 4, "s3": 4}


def test_a_corrupted_object_is_retracted_and_the_other_tier_tried(
    client: Client, tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    stream = LocalCluster.declare_solo(client, "s3-corrupt", "nvme", "s3", mode="any")
    local, remote = tiers(tmp_path, s3_bucket)
    with CheckpointStore(client, stream, 0, local, remote) as store:
        store.save(1, b"first")
        store.save(2, b"second")
        store.flush(timeout=20)
        key = remote.key(stream, 2, 0)
        data = bytearray(s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
        data[-1] ^= 0xFF  # bit rot in the bucket
        s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
        Path(store.path(local, 2)).unlink()  # and the host lost its copy
        with pytest.raises(ShardUnavailableError) as info:
            store.restore(1, timeout=20)
        nvme, s3 = info.value.reasons  # both tiers tried
        assert nvme == "nvme: missing" and s3.startswith("s3: payload digest")
        assert client.state(stream)["newest"]["node-1"] == {"nvme": 1, "s3": 1}  # retracted
        # The other way round: a corrupt local copy, and the object is read instead.
        local_1 = Path(store.path(local, 1))
        local_1.write_bytes(local_1.read_bytes()[:-1])
        shard = store.read(1)
        assert (shard.domain, shard.payload) == ("s3", b"first")
        assert client.state(stream)["newest"]["node-1"] == {"s3": 1}


def test_gc_deletes_from_the_bucket_only_what_is_safe(
    client: Client, tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    stream = LocalCluster.declare_solo(client, "s3-gc", "nvme", "s3", mode="any", retention=1)
    local, remote = tiers(tmp_path, s3_bucket)
    with CheckpointStore(client, stream, 0, local, remote) as store:
        for epoch in range(1, 6):
            store.save(epoch, bytes([epoch]))
        store.flush(timeout=20)
        client.wait(stream, 5, timeout=20)
        _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 3]])
        deleted = store.gc()
        assert sorted((d.domain, d.epoch) for d in deleted) == [
            (domain, e) for domain in ("nvme", "s3") for e in (1, 2, 3)
        ]
        assert s3_bucket.keys() == [remote.key(stream, e, 0) for e in (4, 5)]
        with pytest.raises(ApiError) as info:
            client.commit(stream, 0, "s3", 2)
        assert info.value.reason == "retired"
        assert store.gc() == []
        assert store.restore(1, timeout=20) == Restored(5, b"\x05")


# -- a spare adopts a dead host's rank from the bucket ---------------------------------

STREAM = "s3-moving"
FIRST = {"node-1": [0], "node-2": [1]}
SPARE = {"node-1": [0], "node-3": [1]}  # node-3 replaces node-2


def spec(members: dict[str, list[int]]) -> dict[str, Any]:
    return {
        "name": STREAM,
        "members": members,
        "policy": {"mode": "any", "domains": ["nvme", "s3"]},
        "shared": ["s3"],
    }


def test_a_spare_adopts_the_rank_of_a_dead_host_from_the_bucket(
    tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    shared = ObjectTier("s3", f"{s3_bucket.url}/jobs")

    def nvme(node: int) -> Tier:
        return Tier("nvme", tmp_path / f"node-{node}-nvme")

    def open_all(
        clients: dict[int, Client], members: dict[str, list[int]], launch: Launch
    ) -> dict[int, CheckpointStore]:
        return {
            rank: CheckpointStore(
                clients[node], spec(members), rank, nvme(node), shared, launch=launch
            )
            for node, rank in ((int(n.removeprefix("node-")), r[0]) for n, r in members.items())
        }

    with LocalCluster(3) as cluster:
        for i in (1, 2, 3):
            cluster.start(i, wait=False)
        for i in (1, 2, 3):
            cluster.wait_ready(i)
        clients = {i: cluster.client(i) for i in (1, 2, 3)}
        for c in clients.values():
            until(lambda c=c: c.status()["summary"].startswith("2/"), what="the links")
        stores = open_all(clients, FIRST, new_launch(clients[1], spec(FIRST)))
        for epoch in (1, 2):
            for rank, store in stores.items():
                store.save(epoch, f"rank {rank} epoch {epoch}".encode())
        for store in stores.values():
            store.flush(20)
            store.close()
        # node-2 dies for good, with its state and its disk.
        clients.pop(2).close()
        cluster.kill(2)
        shutil.rmtree(cluster.dir / "node-2" / "state")
        shutil.rmtree(nvme(2).directory)
        until(lambda: clients[3].next_generation(STREAM, timeout=10)["generation"] == 1,
              what="the spare's next generation")  # fmt: skip
        stores = open_all(clients, SPARE, new_launch(clients[1], spec(SPARE)))
        assert stores[1].recommitted is not None
        assert stores[1].recommitted.committed == [("s3", 1), ("s3", 2)]  # from the bucket
        assert clients[3].state(STREAM)["newest"]["node-3"] == {"s3": 2}
        restored = restore_all(stores)
        assert restored == {r: Restored(2, f"rank {r} epoch 2".encode()) for r in (0, 1)}
        assert stores[1].read(2, retract=False).domain == "s3"
        for store in stores.values():
            store.close()
        for c in clients.values():
            c.close()


def restore_all(stores: dict[int, CheckpointStore]) -> dict[int, Restored]:
    """Every rank restores at once (each waits until every member asked)."""
    with ThreadPoolExecutor(len(stores)) as pool:
        futures = {r: pool.submit(s.restore, None, 30) for r, s in stores.items()}
        return {r: f.result() for r, f in futures.items()}
