"""Group commit in front of the write-ahead log.

The daemon applies a fact to the `NodeCore` in memory at once, appends it here, and
lets nothing that could reveal it leave the process (a reply to a client, a frame to
a peer) before `Journal.durable` returns. That single gate gives both promises:
an acknowledged commit survives kill -9, and no peer ever learns of a fact, or a
high-water mark, that a crash could take back.

`durable` is group commit: one fsync runs at a time, in a worker thread, while the
event loop keeps appending; every caller waiting when it finishes is covered by the
next one. Under load a single fsync acknowledges hundreds of commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from convergenced.core.node import NodeCore
from convergenced.daemon.wal import Entry, WriteAheadLog


class Journal:
    """The one path from facts to disk; see the module docstring."""

    def __init__(
        self,
        wal: WriteAheadLog,
        node: NodeCore,
        *,
        on_fsync: Callable[[float, int], None] | None = None,
    ) -> None:
        self.wal = wal
        self.node = node
        self.on_fsync = on_fsync
        """Called with (seconds, entries) after every fsync (metrics)."""
        self._appended = 0
        self._durable = 0
        self._syncing = False
        self._sync_done = trio.Event()

    def record(self, entry: Entry) -> None:
        """Append ``entry`` (already applied in memory); durable after `durable`."""
        self.wal.append(entry)
        self._appended += 1

    @property
    def unsynced(self) -> int:
        """Entries appended but not yet known durable."""
        return self._appended - self._durable

    async def durable(self) -> None:
        """Return once everything applied so far, including the core's own pending
        facts (high-water marks, generation closures), is on disk.

        Raises:
            OSError: the disk refused; the daemon must stop rather than acknowledge.
        """
        for fact in self.node.pending_facts:
            self.record(fact)
        self.node.pending_facts.clear()
        target = self._appended
        while self._durable < target:
            if self._syncing:
                await self._sync_done.wait()
                continue
            self._syncing = True
            # One scheduling round first: every task already runnable (typically the
            # waiters the previous fsync just released) appends its next fact and
            # joins this group instead of forcing a tiny group of its own.
            await trio.lowlevel.checkpoint()
            before, upto = self._durable, self._appended
            data = self.wal.take_pending()
            started = time.monotonic()
            try:
                # Not abandoned on cancellation: an fsync in flight always completes.
                await trio.to_thread.run_sync(self.wal.write_durably, data)
            finally:
                self._syncing = False
                done, self._sync_done = self._sync_done, trio.Event()
                done.set()
            self._durable = upto
            if self.on_fsync is not None:
                self.on_fsync(time.monotonic() - started, upto - before)
