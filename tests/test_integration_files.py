"""The files integration against a real daemon: save and restore, the uploader's
remote commits, a corrupt shard retracted and the other tier used, mixed epochs
refused, garbage collection of exactly the safe epochs, and restore never returning
another epoch than the agreed one."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemons import LocalCluster

from convergenced.client import ApiError, Client
from convergenced.integrations.files import (
    CheckpointError,
    CheckpointStore,
    CorruptShardError,
    MixedEpochError,
    NoRestorePointError,
    RestorePointLostError,
    ShardUnavailableError,
    Tier,
    decode_shard,
    encode_shard,
    load_consistent,
    read_shard,
    shard_path,
    write_atomic,
)


@pytest.fixture(scope="module")
def solo() -> Iterator[LocalCluster]:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        yield cluster


@pytest.fixture
def client(solo: LocalCluster) -> Client:
    return solo.client(1)


_declare = LocalCluster.declare_solo


def _tiers(tmp_path: Path) -> tuple[Tier, Tier]:
    return Tier("nvme", tmp_path / "nvme"), Tier("s3", tmp_path / "bucket")


def _eventually(check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


# -- the format, without a daemon -----------------------------------------------------


def test_shard_format_round_trips_bytes_and_named_parts() -> None:
    data, digest, size = encode_shard("job", 3, 7, b"weights")
    shard = decode_shard(data, stream="job", rank=3, epoch=7)
    assert (shard.payload, shard.digest, shard.size) == (b"weights", digest, size)
    assert digest.startswith("sha256:") and size == 7
    parts = {"model": b"\x00\x01", "optim": b"", "rng": b"seed"}
    shard = decode_shard(encode_shard("job", 0, 1, parts)[0])
    assert shard.payload == parts


@pytest.mark.parametrize(
    ("mangle", "expect", "why"),
    [
        (lambda d: d[:-1], {}, "payload is"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), {}, "digest"),
        (lambda d: b"garbage" + d, {}, "magic"),
        (lambda d: d, {"epoch": 8}, "header epoch is 7, expected 8"),
        (lambda d: d, {"rank": 1}, "header rank"),
        (lambda d: d, {"stream": "other"}, "header stream"),
    ],
)
def test_corrupt_or_misplaced_shards_are_refused(
    mangle: Callable[[bytes], bytes], expect: dict[str, Any], why: str
) -> None:
    data = encode_shard("job", 0, 7, b"payload")[0]
    with pytest.raises(CorruptShardError, match=why):
        decode_shard(mangle(data), **expect)


def test_write_atomic_leaves_only_the_final_file(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "rank-0.shard"
    write_atomic(target, b"one")
    write_atomic(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["rank-0.shard"]


def test_load_consistent_refuses_mixed_epochs(tmp_path: Path) -> None:
    a = decode_shard(encode_shard("job", 0, 10, b"a")[0])
    b = decode_shard(encode_shard("job", 1, 5, b"b")[0])
    with pytest.raises(MixedEpochError, match="rank 0 at epoch 10, rank 1 at epoch 5") as info:
        load_consistent([a, b])
    assert info.value.epochs == {0: 10, 1: 5}
    with pytest.raises(MixedEpochError, match="expected epoch 6"):
        load_consistent([b], epoch=6)
    with pytest.raises(MixedEpochError, match="offered twice"):
        load_consistent([b, b])
    assert load_consistent([a]) == {0: b"a"}


# -- against the daemon ---------------------------------------------------------------


def test_save_and_restore_round_trip(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "roundtrip", "nvme")
    local, _ = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local) as store:
        with pytest.raises(NoRestorePointError, match="start from scratch"):
            store.restore(1, timeout=20)
        for epoch in (1, 2, 3):
            shard = store.save(epoch, {"model": bytes([epoch]) * 8, "step": str(epoch).encode()})
            assert shard.path == local.directory / "roundtrip" / f"epoch-{epoch}" / "rank-0.shard"
        assert store.epochs(local) == [1, 2, 3]
        assert client.state(stream)["newest"]["node-1"]["nvme"] == 3
        client.wait(stream, 3, timeout=20)
        epoch, payload = store.restore(2, timeout=20)
    assert epoch == 3
    assert payload == {"model": b"\x03" * 8, "step": b"3"}
    on_disk = read_shard(local.directory / "roundtrip" / "epoch-3" / "rank-0.shard")
    assert (on_disk.stream, on_disk.rank, on_disk.epoch) == ("roundtrip", 0, 3)


def test_uploader_commits_the_remote_domain(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "upload", "nvme", "s3")  # all of [nvme, s3]
    local, remote = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local, remote, upload_delay=0.2) as store:
        store.save(1, b"one")
        store.save(2, b"two")
        newest = client.state(stream)["newest"]["node-1"]
        assert newest.get("nvme") == 2 and "s3" not in newest  # the upload lags
        assert client.state(stream)["restore_point"] is None
        store.flush(timeout=20)
        assert store.uploaded == [1, 2]
        assert client.state(stream)["newest"]["node-1"]["s3"] == 2
        assert client.wait(stream, 2, timeout=20)["restore_point"] == 2
        remote_shard = read_shard(store.path(remote, 2), stream=stream, rank=0, epoch=2)
        assert remote_shard.payload == b"two"


def test_corrupt_local_shard_is_retracted_and_the_remote_one_used(
    client: Client, tmp_path: Path
) -> None:
    stream = _declare(client, "fallback", "nvme", "s3", mode="any")
    local, remote = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local, remote) as store:
        store.save(1, b"first")
        store.save(2, b"second")
        store.flush(timeout=20)
        client.wait(stream, 2, timeout=20)
        _flip_last_byte(store.path(local, 2))
        assert store.restore(1, timeout=20) == (2, b"second")
        newest = client.state(stream)["newest"]["node-1"]
        assert newest == {"nvme": 1, "s3": 2}  # nvme epoch 2 was retracted
        shard = store.read(2)
        assert shard.domain == "s3"


def test_restore_never_returns_another_epoch(client: Client, tmp_path: Path) -> None:
    # Retention 1: a rollback from epoch 2 may reach epoch 1 (the rollback floor).
    stream = _declare(client, "exact", "nvme", retention=1)
    local, _ = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local) as store:
        store.save(1, b"one")
        store.save(2, b"two")
        client.wait(stream, 2, timeout=20)
        # A crash between writing epoch 3 and committing it: the file is there, but
        # the agreed restore point is 2, and restore returns exactly that.
        write_atomic(store.path(local, 3), encode_shard(stream, 0, 3, b"three")[0])
        assert store.restore(1, timeout=20) == (2, b"two")
        # Epoch 2 replaced by a misplaced copy of epoch 1: refused, never served as 2.
        store.path(local, 2).write_bytes(store.path(local, 1).read_bytes())
        with pytest.raises(ShardUnavailableError, match="header epoch is 1, expected 2"):
            store.restore(1, timeout=20)
        # It was retracted: the generation's answer is lost, and a newer generation
        # agrees on epoch 1.
        with pytest.raises(RestorePointLostError, match="newer generation"):
            store.restore(1, timeout=20)
        assert store.restore(2, timeout=20) == (1, b"one")


def test_restore_all_assembles_one_epoch_from_every_rank(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "multi", "nvme", ranks=2)
    local, _ = _tiers(tmp_path)
    stores = [CheckpointStore(client, stream, r, local) for r in (0, 1)]
    for epoch in (1, 2):
        for r, store in enumerate(stores):
            store.save(epoch, f"rank {r} epoch {epoch}".encode())
    stores[0].save(3, b"rank 0 epoch 3")  # rank 1 never got to save epoch 3
    client.wait(stream, 2, timeout=20)
    epoch, payloads = stores[0].restore_all(1, [0, 1], timeout=20)
    assert epoch == 2
    assert payloads == {0: b"rank 0 epoch 2", 1: b"rank 1 epoch 2"}
    # What a latest marker would assemble: rank 0's newest and rank 1's newest.
    newest = [
        read_shard(stores[0].path(local, 3)),
        read_shard(stores[1].path(local, 2)),
    ]
    with pytest.raises(MixedEpochError, match="mixed epochs"):
        load_consistent(newest)
    for store in stores:
        store.close()


def test_gc_deletes_only_safe_epochs_and_retires_them(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "gc", "nvme", "s3", mode="any", retention=1)
    local, remote = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local, remote) as store:
        for epoch in range(1, 6):
            store.save(epoch, bytes([epoch]))
        store.flush(timeout=20)
        client.wait(stream, 5, timeout=20)
        # Restore point 5, retention 1: epochs below 4 are safe once 5 is published.
        _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 3]])
        deleted = store.gc()
        assert sorted((d.domain, d.epoch) for d in deleted) == [
            (domain, e) for domain in ("nvme", "s3") for e in (1, 2, 3)
        ]
        assert store.epochs(local) == store.epochs(remote) == [4, 5]
        assert not (local.directory / "gc" / "epoch-1").exists()
        with pytest.raises(ApiError) as info:
            client.commit(stream, 0, "nvme", 2)
        assert info.value.reason == "retired"
        assert store.gc() == []  # nothing more is safe
        # A recovery generation freezes {4, 5}: they stay even once below the horizon.
        assert store.restore(1, timeout=20) == (5, b"\x05")
        for epoch in (6, 7, 8):
            store.save(epoch, bytes([epoch]))
        store.flush(timeout=20)
        client.wait(stream, 8, timeout=20)
        _eventually(lambda: client.state(stream)["gc_horizon"] == 7)
        deleted = store.gc()
        assert sorted((d.domain, d.epoch) for d in deleted) == [("nvme", 6), ("s3", 6)]
        assert store.epochs(local) == [4, 5, 7, 8]


def test_restore_without_a_generation_opens_a_new_one_for_a_single_rank(
    client: Client, tmp_path: Path
) -> None:
    stream = _declare(client, "relaunched", "nvme")
    local, _ = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local) as store:
        with pytest.raises(NoRestorePointError):
            store.restore(timeout=20)  # the first launch: generation 1, nothing yet
        store.save(1, b"one")
        client.wait(stream, 1, timeout=20)
        # The relaunch gets generation 2, not generation 1's final answer (none).
        assert store.restore(timeout=20) == (1, b"one")
        assert client.state(stream)["generations"] == [2]
        assert store.next_generation() == 3
    two = _declare(client, "two-ranks", "nvme", ranks=2)
    with pytest.raises(CheckpointError, match="has 2 ranks"):
        CheckpointStore(client, two, 0, local).restore(timeout=20)


def test_a_rerun_from_scratch_does_not_count_retired_epochs_and_trains_on(
    client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stream = _declare(client, "rerun", "nvme")
    local, _ = _tiers(tmp_path)
    with CheckpointStore(client, stream, 0, local) as store:
        for epoch in (1, 2, 3):
            store.save(epoch, bytes([epoch]))
        client.wait(stream, 3, timeout=20)
        _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 2]])
        assert [d.epoch for d in store.gc()] == [1, 2]
    with CheckpointStore(client, stream, 0, local) as rerun:  # the same script again
        with caplog.at_level(logging.WARNING, logger="convergenced.integrations.files"):
            shard = rerun.save(1, b"one, again")
        assert not shard.committed and shard.path is None
        assert "epoch 1 was retired from nvme" in caplog.text
        assert rerun.skipped == [1] and rerun.epochs(local) == [3]
        assert rerun.save(4, b"four").committed
        assert client.wait(stream, 4, timeout=20)["recoverable"] == [[3, 4]]


def test_gc_before_upload_skips_the_upload(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "lagging", "nvme", "s3", mode="any")
    local, remote = _tiers(tmp_path)
    store = CheckpointStore(client, stream, 0, local, remote, upload_delay=0.5)
    store.save(1, b"one")
    store.save(2, b"two")
    client.wait(stream, 2, timeout=20)
    _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 1]])
    assert [(d.domain, d.epoch) for d in store.gc()] == [("nvme", 1)]
    store.close(timeout=20)  # epoch 1's upload finds it collected and skips it
    assert store.uploaded == [2]
    assert store.epochs(remote) == [2]
    with pytest.raises(Exception, match="closed"):
        store.save(3, b"three")


def test_close_without_flush_drops_pending_uploads(client: Client, tmp_path: Path) -> None:
    stream = _declare(client, "crash", "nvme", "s3", mode="any")
    local, remote = _tiers(tmp_path)
    store = CheckpointStore(client, stream, 0, local, remote, upload_delay=30)
    store.save(1, b"one")
    started = time.monotonic()
    store.close(flush=False)  # as a crash would: no upload, no waiting for the lag
    assert time.monotonic() - started < 10
    assert store.uploaded == [] and store.epochs(remote) == []
    assert "s3" not in client.state(stream)["newest"]["node-1"]


def test_a_temp_file_left_by_a_crashed_writer_is_swept_at_start(tmp_path: Path) -> None:
    """A crash between writing a shard's temp file and renaming it leaves the temp file;
    the next store of that rank removes it (so gc can remove the epoch directory), and
    leaves other ranks' files alone."""
    local = Tier("nvme", tmp_path / "nvme")
    epoch_dir = shard_path(local.directory, "job", 3, 0).parent
    epoch_dir.mkdir(parents=True)
    stale = epoch_dir / ".rank-0.shard.999999.1.tmp"
    other_rank = epoch_dir / ".rank-1.shard.999999.1.tmp"
    stale.write_bytes(b"half a shard")
    other_rank.write_bytes(b"not ours")
    no_daemon: Any = object()  # the sweep happens before any request
    store = CheckpointStore(no_daemon, "job", 0, local)
    assert store.swept == [stale]
    assert not stale.exists() and other_rank.exists()


def test_a_store_opening_commits_again_the_verified_shards_it_finds(
    client: Client, tmp_path: Path
) -> None:
    """What the tiers hold is committed again when a store opens: shards that verify,
    read once (a second pass reads only a rewritten file); not a corrupt one; and a
    shard of an epoch the daemon says was retired (a deletion cut short) is deleted."""
    stream = _declare(client, "reopen", "nvme", retention=1)
    local = Tier("nvme", tmp_path / "nvme")
    with CheckpointStore(client, stream, 0, local) as store:
        assert store.recommitted is not None and store.recommitted.committed == []
        for epoch in range(1, 6):
            store.save(epoch, bytes([epoch]))
        client.wait(stream, 5, timeout=20)
        _eventually(lambda: client.state(stream)["safe_to_delete"] == [[1, 3]])
        assert len(store.gc()) == 3
    # Epoch 2 back on disk (retired: its deletion was cut short); epoch 6 corrupt; epoch
    # 7 written but never committed (a crash before the commit, or a daemon that lost
    # its state).
    write_atomic(shard_path(local.directory, stream, 2, 0), encode_shard(stream, 0, 2, b"2")[0])
    data = bytearray(encode_shard(stream, 0, 6, b"six")[0])
    data[-1] ^= 1
    write_atomic(shard_path(local.directory, stream, 6, 0), bytes(data))
    write_atomic(shard_path(local.directory, stream, 7, 0), encode_shard(stream, 0, 7, b"7")[0])
    with CheckpointStore(client, stream, 0, local) as store:
        done = store.recommitted
        assert done is not None
        assert done.committed == [("nvme", 4), ("nvme", 5), ("nvme", 7)]
        assert done.read == [("nvme", e) for e in (2, 4, 5, 6, 7)]
        assert done.corrupt == [("nvme", 6)] and done.deleted == [("nvme", 2)]
        assert store.epochs(local) == [4, 5, 6, 7]
        assert client.state(stream)["newest"]["node-1"]["nvme"] == 7
        again = store.ledger.recommit()  # what a reconnect runs: nothing is read again
        assert again.read == [] and again.committed == done.committed
        write_atomic(shard_path(local.directory, stream, 7, 0), encode_shard(stream, 0, 7, b"7")[0])
        assert store.ledger.recommit().read == [("nvme", 7)]
