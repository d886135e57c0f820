"""Group commit and the output gate (`Journal`), and the dialler's backoff.

The journal writes a real file with real fsyncs; the WAL itself (torn tails,
corruption) has its own tests in test_wal.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import trio

from convergenced.core.facts import Commit, Declare
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.dialer import Backoff
from convergenced.daemon.journal import Journal
from convergenced.daemon.wal import WriteAheadLog

SPEC = StreamSpec.create("job", {"n": list(range(64))}, Policy.all_of("nvme"))


def _journal(tmp_path: Path) -> tuple[Journal, WriteAheadLog, NodeCore]:
    wal, _, _ = WriteAheadLog.open(tmp_path / "facts.wal")
    node = NodeCore("n", 1)
    return Journal(wal, node), wal, node


async def test_concurrent_commits_share_fsyncs_and_all_survive(tmp_path: Path) -> None:
    journal, wal, node = _journal(tmp_path)
    syncs: list[int] = []
    journal.on_fsync = lambda seconds, entries: syncs.append(entries)
    node.apply(Declare(SPEC))
    journal.record(Declare(SPEC))

    async def commit(rank: int) -> None:
        for epoch in range(1, 11):
            fact = Commit("job", rank, "nvme", epoch)
            node.apply(fact)
            journal.record(fact)
            await journal.durable()

    async with trio.open_nursery() as nursery:
        for rank in range(64):
            nursery.start_soon(commit, rank)
    assert journal.unsynced == 0
    assert len(syncs) < 640 // 4  # group commit: many commits per fsync (typically ~40)
    wal.close()
    _, entries, report = WriteAheadLog.open(tmp_path / "facts.wal")
    assert report.torn_tail_bytes == 0
    assert sum(isinstance(e, Commit) for e in entries) == 640
    assert sum(syncs) == len(entries)  # every entry synced exactly once


async def test_without_group_commit_every_entry_gets_its_own_fsync(tmp_path: Path) -> None:
    wal, _, _ = WriteAheadLog.open(tmp_path / "facts.wal")
    node = NodeCore("n", 1)
    journal = Journal(wal, node, group_commit=False)
    syncs: list[int] = []
    journal.on_fsync = lambda seconds, entries: syncs.append(entries)
    node.apply(Declare(SPEC))
    journal.record(Declare(SPEC))

    async def commit(rank: int) -> None:
        for epoch in range(1, 4):
            fact = Commit("job", rank, "nvme", epoch)
            node.apply(fact)
            journal.record(fact)
            await journal.durable()

    async with trio.open_nursery() as nursery:
        for rank in range(8):
            nursery.start_soon(commit, rank)
    wal.close()
    _, entries, _ = WriteAheadLog.open(tmp_path / "facts.wal")
    assert sum(isinstance(e, Commit) for e in entries) == 24
    assert syncs == [1] * len(entries) and wal.syncs == len(entries)


async def test_durable_also_logs_the_cores_own_pending_facts(tmp_path: Path) -> None:
    journal, wal, node = _journal(tmp_path)
    node.apply(Declare(StreamSpec.create("solo", {"n": [0]}, Policy.all_of("nvme"))))
    node.apply(Commit("solo", 0, "nvme", 3))
    await journal.durable()  # the restore point rose: a high-water mark to persist
    assert not node.take_pending_facts()
    wal.close()
    _, entries, _ = WriteAheadLog.open(tmp_path / "facts.wal")
    assert [type(e).__name__ for e in entries] == ["HighWater"]


async def test_durable_with_nothing_pending_does_not_touch_the_disk(tmp_path: Path) -> None:
    journal, wal, _ = _journal(tmp_path)
    await journal.durable()
    assert wal.syncs == 0


def test_backoff_grows_with_jitter_caps_and_resets() -> None:
    b = Backoff(initial=0.1, maximum=1.0, rng=random.Random(1))
    waits = [b.next() for _ in range(8)]
    steps = [min(1.0, 0.1 * 2**i) for i in range(8)]
    assert all(s / 2 <= w <= s for w, s in zip(waits, steps, strict=True))
    assert max(waits[5:]) <= 1.0
    b.reset()
    assert b.next() <= 0.1
