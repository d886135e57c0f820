"""Group commit behind the output gate: facts share fsyncs, the core's own facts are
logged, compaction keeps everything, a failed fsync poisons the log.

A real log file, on a disk that takes 30 ms of trio's virtual time per write
(`slowdisk.SlowDisk` under `MockClock`): no test here sleeps.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest
import trio
import trio.testing
from slowdisk import slow_log

from convergenced.core.facts import Commit, Declare, HighWater, Horizon
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import Incarnation
from convergenced.daemon.durability.group_commit import LogFailedError
from convergenced.daemon.durability.log_file import FactLog

SPEC = StreamSpec.create("job", {"n": list(range(64))}, Policy.all_of("nvme"))
DISK_S = 0.03


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


async def test_concurrent_commits_share_fsyncs_and_all_survive(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    gate, commits, witness = slow_log(tmp_path, node, DISK_S)
    gate.apply(Declare(SPEC))

    async def commit(rank: int) -> None:
        for epoch in range(1, 11):
            gate.apply(Commit("job", rank, "nvme", epoch))
            await commits.durable()

    async with trio.open_nursery() as nursery:
        for rank in range(64):
            nursery.start_soon(commit, rank)
    assert not gate.pending()
    writes = commits.telemetry.counters()["wal_fsyncs"]
    assert writes <= 20  # about one write per round of 64 commits, not one per commit
    assert trio.current_time() <= writes * DISK_S + 1e-9
    commits.log.close()
    _, entries, report = FactLog.open(tmp_path / "n.wal")
    assert report.torn_tail_bytes == 0
    assert sum(isinstance(e, Commit) for e in entries) == 640
    assert entries == witness.durable


async def test_without_group_commit_every_entry_gets_its_own_fsync(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    gate, commits, _ = slow_log(tmp_path, node, DISK_S, one_by_one=True)
    gate.apply(Declare(SPEC))

    async def commit(rank: int) -> None:
        for epoch in range(1, 4):
            gate.apply(Commit("job", rank, "nvme", epoch))
            await commits.durable()

    async with trio.open_nursery() as nursery:
        for rank in range(8):
            nursery.start_soon(commit, rank)
    counters = commits.telemetry.counters()
    assert counters["wal_fsyncs"] == counters["wal_entries"] == 25


async def test_durable_also_logs_the_cores_own_facts(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    gate, commits, witness = slow_log(tmp_path, node, DISK_S)
    gate.apply(Declare(StreamSpec.create("solo", {"n": [0]}, Policy.all_of("nvme"))))
    gate.apply(Commit("solo", 0, "nvme", 3))  # the restore point rises: a mark to persist
    await commits.durable()
    assert [type(e) for e in witness.durable] == [Declare, Commit, HighWater, Horizon]


async def test_waiting_for_what_is_durable_does_not_touch_the_disk(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    _, commits, _ = slow_log(tmp_path, node, DISK_S)
    await commits.durable()
    await commits.durable(0)
    assert "wal_fsyncs" not in commits.telemetry.counters()
    assert trio.current_time() == 0


async def test_a_compaction_keeps_every_fact_applied_during_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    gate, commits, _ = slow_log(tmp_path, node, DISK_S)
    gate.apply(Declare(SPEC))
    for e in range(1, 6):
        gate.apply(Commit("job", 0, "nvme", e))
    await commits.durable()

    async def during() -> None:
        await trio.sleep(DISK_S / 2)  # while the compaction's write is in flight
        gate.apply(Commit("job", 1, "nvme", 1))
        await commits.durable()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(during)
        await commits.compact(lambda: [Incarnation(1), *node.compacted_facts()])
    commits.log.close()
    _, entries, _ = FactLog.open(tmp_path / "n.wal")
    again = NodeCore("n", 2)
    again.replay(e for e in entries if not isinstance(e, Incarnation))
    assert again.status("job").newest == node.status("job").newest
    assert Commit("job", 1, "nvme", 1) in entries
    assert commits.telemetry.counters()["wal_compactions"] == 1


async def test_a_failed_fsync_poisons_the_log(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    failures: list[BaseException] = []
    gate, commits, _ = slow_log(tmp_path, node, DISK_S, on_failure=failures.append)

    def broken(data: bytes) -> None:
        raise OSError(5, "Input/output error")

    commits.log.write_durably = broken  # type: ignore[method-assign]
    gate.apply(Declare(SPEC))
    with pytest.raises(OSError, match="Input/output"):
        await commits.durable()
    assert len(failures) == 1
    gate.apply(Commit("job", 0, "nvme", 1))
    with pytest.raises(LogFailedError):  # never retried: the pages may be gone
        await commits.durable()
    assert len(failures) == 1


async def test_a_compaction_without_a_free_descriptor_leaves_the_log_in_use(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    node = NodeCore("n", 1)
    gate, commits, _ = slow_log(tmp_path, node, DISK_S)
    gate.apply(Declare(SPEC))
    for e in range(1, 6):
        gate.apply(Commit("job", 0, "nvme", e))
    await commits.durable()
    gate.apply(Commit("job", 1, "nvme", 1))  # not yet logged when the compaction starts
    lowest_free = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # a real EMFILE
    try:
        await commits.compact(lambda: [Incarnation(1), *node.compacted_facts()])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert commits.failure is None
    assert commits.telemetry.counters()["wal_compactions_deferred"] == 1
    gate.apply(Commit("job", 1, "nvme", 2))
    await commits.durable()  # the old log goes on, with what the compaction took
    _, entries, _ = FactLog.open(tmp_path / "n.wal")
    assert entries[-2:] == [Commit("job", 1, "nvme", 1), Commit("job", 1, "nvme", 2)]
    await commits.compact(lambda: [Incarnation(1), *node.compacted_facts()])  # once it can
    commits.log.close()
    _, entries, _ = FactLog.open(tmp_path / "n.wal")
    again = NodeCore("n", 2)
    again.replay(e for e in entries if not isinstance(e, Incarnation))
    assert again.status("job").newest == node.status("job").newest
    assert commits.telemetry.counters()["wal_compactions"] == 1
    assert not list(tmp_path.glob(".*.tmp"))
