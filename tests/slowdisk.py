"""A disk for the group commit that takes its time in trio's virtual clock.

`SlowDisk` runs the log's blocking calls (writes and fsyncs of a real file in a
temporary directory) inline, after ``delay`` seconds of trio time, so tests under
`trio.testing.MockClock` can model a slow disk without sleeping. `Witness` records,
for a `FactLog`, which facts each completed write made durable, which is the ground
truth the ordering tests check the bytes on the wire against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from convergenced.core.facts import Commit, Fact, HighWater
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.daemon.durability.entries import Entry
from convergenced.daemon.durability.group_commit import GroupCommit
from convergenced.daemon.durability.log_file import FactLog
from convergenced.daemon.telemetry import Telemetry


class SlowDisk:
    """Runs each call after ``delay`` seconds of (virtual) time; never abandons one."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.calls = 0

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with trio.CancelScope(shield=True):
            await trio.sleep(self.delay)
        self.calls += 1
        return fn(*args)

    def close(self) -> None:
        pass


class Witness:
    """What a `FactLog` has really made durable, by watching its appends and writes."""

    def __init__(self, log: FactLog) -> None:
        self.appended: list[Entry] = []
        self.durable: list[Entry] = []
        append, write = log.append, log.write_durably

        def watched_append(entry: Entry) -> None:
            self.appended.append(entry)
            append(entry)

        def watched_write(data: bytes) -> None:
            taken = list(self.appended)  # everything appended is in this write or earlier
            write(data)
            self.durable = taken

        log.append = watched_append  # type: ignore[method-assign]
        log.write_durably = watched_write  # type: ignore[method-assign]

    def high_water(self) -> int | None:
        """The highest durable high-water mark."""
        marks = [e.epoch for e in self.durable if isinstance(e, HighWater)]
        return max(marks, default=None)

    def committed(self) -> set[tuple[int, str, int]]:
        """(rank, domain, epoch) of every durable commit."""
        return {(e.rank, e.domain, e.epoch) for e in self.durable if isinstance(e, Commit)}

    def reveals_only_durable(self, record: Record, ranks: tuple[int, ...], domain: str) -> bool:
        """Whether ``record`` claims no mark or epoch the log has not made durable."""
        hw = self.high_water()
        for epoch in (record.high_water, record.restore_point):
            if epoch is not None and (hw is None or epoch > hw):
                return False
        top = record.recoverable.max()
        committed = self.committed()
        return top is None or all((r, domain, top) in committed for r in ranks)


def slow_log(
    tmp_path: Path, node: NodeCore, delay: float, **kwargs: Any
) -> tuple[OutputGate, GroupCommit, Witness]:
    """A gate and a group commit for ``node`` over a real log file on a slow disk."""
    log, _, _ = FactLog.open(tmp_path / f"{node.node_id}.wal")
    gate = OutputGate(node)
    witness = Witness(log)
    commits = GroupCommit(log, gate, Telemetry(), disk=SlowDisk(delay), **kwargs)
    return gate, commits, witness


__all__ = ["Fact", "SlowDisk", "Witness", "slow_log"]
