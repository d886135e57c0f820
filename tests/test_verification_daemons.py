"""Background verification with real daemons: ranks save shards through the files
integration (whose commits carry their location), a shard is damaged on disk, and
each daemon's verifier finds it within its period.

- With an all-of policy, the damaged shard of the restore point is retracted, the
  restore point rolls back on every node, and the daemon's metrics show it.
- With an any-of policy, the intact copy in the other domain keeps the restore point,
  and the figures show the lost copy.
- A drill (``convergencectl drill``) restores the restore point into a scratch folder,
  runs the hook, reports its figures and records its outcome; a damaged checkpoint
  fails it and is retracted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from daemons import LocalCluster, until
from s3server import S3Bucket, require_s3fs

from convergenced.integrations.files import CheckpointStore, Tier
from convergenced.integrations.objectstore import ObjectTier

STREAM = "job"
PERIOD_S = 0.3
EXTRA = f"verification = {{ period_s = {PERIOD_S}, bandwidth_mb_s = 0 }}"


def _flip(where: Path | str) -> None:
    # In place, one byte, as bit rot does: rewriting the file would truncate it first,
    # and a verification pass reading it then sees an empty file ("corrupt"), not the
    # flipped byte ("mismatch") the tests wait for.
    with Path(where).open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))


def _save(stores: list[CheckpointStore], epochs: range) -> None:
    for epoch in epochs:
        for store in stores:
            store.save(epoch, f"rank {store.rank} epoch {epoch}".encode() * 64)


def test_all_of_a_corrupt_shard_of_the_restore_point_rolls_back_every_node(
    tmp_path: Path,
) -> None:
    with LocalCluster(2, extra=EXTRA) as cluster:
        cluster.start_all()
        spec = cluster.spec(STREAM, retention=4, mode="all", domains=["nvme"])
        clients = [cluster.client(1), cluster.client(2)]
        for c in clients:
            c.declare(spec)
        stores = [
            CheckpointStore(clients[r], STREAM, r, Tier("nvme", tmp_path / f"node-{r + 1}"))
            for r in range(2)
        ]
        _save(stores, range(1, 4))
        assert clients[0].wait(STREAM, 3, timeout=20)["restore_point"] == 3
        until(lambda: clients[1].state(STREAM)["verification"]["nvme"]["verified"])
        before = cluster.metrics(2)
        assert before['convergenced_verifications_total{domain="nvme",outcome="ok"}'] >= 3

        _flip(stores[1].path(stores[1].local, 3))  # rank 1's shard of epoch 3, on node-2
        for c in clients:
            until(lambda c=c: c.state(STREAM)["restore_point"] == 2)
        after = cluster.metrics(2)
        assert after['convergenced_verifications_total{domain="nvme",outcome="mismatch"}'] == 1
        assert after['convergenced_retractions_total{stream="job"}'] == 1
        assert after['convergenced_restore_point_epoch{stream="job"}'] == 2
        assert cluster.metrics(1)['convergenced_rollbacks_total{stream="job"}'] >= 1
        state = clients[1].state(STREAM)
        assert state["newest"][cluster.name(2)] == {"nvme": 2}
        assert state["verification"]["nvme"]["restore_point"] == 2
        assert "checkpoint failed verification: retracted" in cluster.log(2)
        for store in stores:
            store.close()


def test_any_of_the_intact_copy_keeps_the_restore_point(tmp_path: Path) -> None:
    with LocalCluster(2, extra=EXTRA) as cluster:
        cluster.start_all()
        spec = cluster.spec(STREAM, retention=4, mode="any", domains=["nvme", "pfs"])
        clients = [cluster.client(1), cluster.client(2)]
        for c in clients:
            c.declare(spec)
        stores = [
            CheckpointStore(
                clients[r],
                STREAM,
                r,
                Tier("nvme", tmp_path / f"node-{r + 1}"),
                Tier("pfs", tmp_path / "pfs"),
            )
            for r in range(2)
        ]
        _save(stores, range(1, 3))
        for s in stores:
            s.flush()
        until(lambda: clients[1].state(STREAM)["newest"][cluster.name(2)].get("pfs") == 2)
        assert clients[0].wait(STREAM, 2, timeout=20)["restore_point"] == 2
        stored = clients[1].state(STREAM)["stored_epochs"]

        _flip(stores[1].path(stores[1].local, 2))  # node-2's local copy of epoch 2
        until(
            lambda: (
                cluster.metrics(2).get(
                    'convergenced_verifications_total{domain="nvme",outcome="mismatch"}'
                )
                == 1
            )
        )
        state = clients[1].state(STREAM)
        assert state["restore_point"] == 2  # the pfs copy still restores it
        assert state["newest"][cluster.name(2)] == {"nvme": 1, "pfs": 2}
        assert state["stored_epochs"]["nvme"] == stored["nvme"] - 1
        m = cluster.metrics(2)
        assert m['convergenced_stored_epochs{domain="nvme",stream="job"}'] == stored["nvme"] - 1
        assert m['convergenced_restore_point_verified_age_seconds{domain="pfs",stream="job"}'] < 60
        for store in stores:
            store.close()


HOOK = """
import json, os, pathlib, sys
locations = json.loads(os.environ["CONVERGENCED_DRILL_LOCATIONS"])
scratch = pathlib.Path(os.environ["CONVERGENCED_DRILL_DIR"])
for loc in locations:  # "load" each restored shard: here, check that it is there
    shard = scratch / loc["domain"] / f"rank-{loc['rank']}" / "shard"
    assert shard.read_bytes().startswith(b"CVGSHARD1 "), shard
print("loaded", len(locations), "shards of epoch", os.environ["CONVERGENCED_DRILL_EPOCH"])
sys.exit(int(os.environ.get("DRILL_HOOK_EXIT", "0")))
"""


def _ctl(cluster: LocalCluster, i: int, *args: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(i)), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_a_drill_restores_the_restore_point_and_reports_its_figures(tmp_path: Path) -> None:
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    scratch = tmp_path / "scratch"
    drill = f'drill = {{ hook = ["{sys.executable}", "{hook}"], scratch = "{scratch}" }}'
    with LocalCluster(2, extra=drill) as cluster:
        cluster.start_all()
        spec = cluster.spec(STREAM, retention=4, mode="all", domains=["nvme"])
        clients = [cluster.client(1), cluster.client(2)]
        for c in clients:
            c.declare(spec)
        stores = [
            CheckpointStore(clients[r], STREAM, r, Tier("nvme", tmp_path / f"node-{r + 1}"))
            for r in range(2)
        ]
        _save(stores, range(1, 3))
        assert clients[0].wait(STREAM, 2, timeout=20)["restore_point"] == 2

        code, out = _ctl(cluster, 2, "drill", STREAM, "--json")
        assert code == 0, out
        result = json.loads(out)
        assert result["passed"] and result["epoch"] == 2
        (rank,) = result["ranks"]
        assert (rank["rank"], rank["domain"], rank["outcome"]) == (1, "nvme", "ok")
        assert rank["bytes"] == len(b"rank 1 epoch 2" * 64) and rank["mb_s"] > 0
        assert result["domains"]["nvme"]["ranks"] == 1
        assert (
            result["hook"]["exit"] == 0 and "loaded 1 shards of epoch 2" in result["hook"]["output"]
        )
        assert not any(scratch.iterdir())  # the restored copy is removed afterwards
        state = clients[1].state(STREAM)["drill"]
        assert state["passed"] and state["epoch"] == 2
        records = (
            (cluster.dir / cluster.name(2) / "state" / "drills.jsonl").read_text().splitlines()
        )
        assert [json.loads(line)["passed"] for line in records] == [True]

        code, out = _ctl(cluster, 2, "drill", STREAM, "--epoch", "1")  # an older epoch
        assert code == 0 and "epoch 1: passed" in out, out
        _flip(stores[1].path(stores[1].local, 2))
        code, out = _ctl(cluster, 2, "drill", STREAM)
        assert code == 1 and "FAILED" in out and "mismatch" in out, out
        for c in clients:  # the drill's evidence retracted it, as the verifier would
            until(lambda c=c: c.state(STREAM)["restore_point"] == 1)
        m = cluster.metrics(2)
        assert m['convergenced_drills_total{outcome="passed"}'] == 2
        assert m['convergenced_drills_total{outcome="failed"}'] == 1
        assert m['convergenced_drill_load_bytes_per_second{domain="nvme"}'] > 0
        code, out = _ctl(cluster, 2, "drill", "nosuch")
        assert code == 1 and "unknown_stream" in out, out
        for store in stores:
            store.close()


def test_the_verifier_reads_an_object_store_and_retracts_a_rotten_object(
    tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    """The remote tier's commits carry ``s3://`` locations; the daemon reads them through
    fsspec's S3 filesystem with the standard AWS configuration of its environment (here,
    the real S3 API server's)."""
    require_s3fs()
    with LocalCluster(1, extra=EXTRA) as cluster:  # started inside the bucket's environment
        cluster.start_all()
        client = cluster.client(1)
        stream = LocalCluster.declare_solo(client, STREAM, "nvme", "s3", mode="any")
        remote = ObjectTier("s3", f"{s3_bucket.url}/ckpt")
        with CheckpointStore(client, stream, 0, Tier("nvme", tmp_path / "nvme"), remote) as store:
            store.save(1, b"first" * 100)
            store.save(2, b"second" * 100)
            store.flush(timeout=20)
            until(lambda: cluster.metrics(1).get(
                'convergenced_verifications_total{domain="s3",outcome="ok"}', 0) >= 2)  # fmt: skip
            key = remote.key(stream, 2, 0)
            body = s3_bucket.client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read()
            rotten = body[:-1] + bytes([body[-1] ^ 0xFF])  # bit rot in the bucket
            s3_bucket.client.put_object(Bucket=s3_bucket.name, Key=key, Body=rotten)
            until(lambda: client.state(stream)["newest"]["node-1"] == {"nvme": 2, "s3": 1})
            m = cluster.metrics(1)
            assert m['convergenced_verifications_total{domain="s3",outcome="mismatch"}'] == 1
            assert client.state(stream)["restore_point"] == 2  # the local copy keeps it
