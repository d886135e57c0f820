"""Group commit in front of the write-ahead log.

The daemon applies a fact to the `NodeCore` in memory at once, appends it here, and
lets nothing that could reveal it leave the process (a reply to a client, a frame to
a peer) before `Journal.durable` returns. That single gate gives both promises:
an acknowledged commit survives kill -9, and no peer ever learns of a fact, or a
high-water mark, that a crash could take back.

`durable` is group commit: one fsync runs at a time, in a worker thread, while the
event loop keeps appending; every caller waiting when it finishes is covered by the
next one. Under load a single fsync acknowledges hundreds of commits.

**A failed write or fsync poisons the journal.** After a failed fsync the kernel may
already have dropped the dirty pages, so a retry can "succeed" without the data
("fsyncgate"). Every later `durable` raises `JournalFailedError`; the daemon stops
instead of acknowledging anything more, and the restart replays what is really on
disk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from convergenced.core.node import NodeCore
from convergenced.daemon.wal import Entry, WriteAheadLog, encode_entries


class DiskThread:
    """One long-lived thread for the log's blocking writes, fsyncs and renames.

    Cheaper than `trio.to_thread.run_sync` per fsync (measured here: about 90 us of
    CPU per round trip against 128 us), and it keeps the log's I/O strictly ordered
    on a single thread. `run` never abandons a job: a cancelled caller still waits
    for the disk, because the journal must know whether the write happened.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the disk thread; return its result or raise its error."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="convergenced-wal", daemon=True)
            self._thread.start()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        outcome: list[Any] = []

        def job() -> None:
            try:
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the caller below
                outcome.append((False, exc))
            token.run_sync_soon(done.set)

        self._jobs.put(job)
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Let the thread finish its queue and exit."""
        if self._thread is not None:
            self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


class JournalFailedError(OSError):
    """A write or fsync of the log failed earlier: nothing can be acknowledged."""


class Journal:
    """The one path from facts to disk; see the module docstring."""

    def __init__(
        self,
        wal: WriteAheadLog,
        node: NodeCore,
        *,
        on_fsync: Callable[[float, int], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        group_commit: bool = True,
    ) -> None:
        self.wal = wal
        self.group_commit = group_commit
        """False: one write and fsync per entry, as a log without group commit would
        do (``wal_group_commit = false``; for measuring what grouping buys)."""
        self.node = node
        self.on_fsync = on_fsync
        """Called with (seconds, entries) after every fsync (metrics)."""
        self._appended = 0
        self._durable = 0
        self._syncing = False
        self._sync_done = trio.Event()
        self._disk = DiskThread()
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        """Called once, with the error, when a write or fsync fails."""

    def close(self) -> None:
        """Stop the disk thread (after the last `durable`)."""
        self._disk.close()

    def record(self, entry: Entry) -> None:
        """Append ``entry`` (already applied in memory); durable after `durable`."""
        self.wal.append(entry)
        self._appended += 1

    @property
    def unsynced(self) -> int:
        """Entries appended but not yet known durable."""
        return self._appended - self._durable

    def _absorb_core_facts(self) -> None:
        for fact in self.node.take_pending_facts():
            self.record(fact)

    async def compact(self, snapshot: Callable[[], Sequence[Entry]]) -> int:
        """Rewrite the log as ``snapshot()`` (atomically); return its size in bytes.

        ``snapshot`` must describe everything applied so far (the node's
        `compacted_facts`). It is taken while no fsync runs, at the same instant the
        unsynced appends are dropped: they are all inside it. Appends made while the
        new file is written go to the new file with the next group.
        """
        while self._syncing:
            await self._sync_done.wait()
        self._check_failure()
        self._syncing = True
        try:
            self._absorb_core_facts()
            self.wal.take_pending()  # every one of these is inside the snapshot
            upto = self._appended
            body = encode_entries(list(snapshot()))
            try:
                await self._disk.run(self.wal.replace_durably, body)
            except Exception as exc:
                self._fail(exc)
                raise
            self._durable = max(self._durable, upto)
        finally:
            self._syncing = False
            done, self._sync_done = self._sync_done, trio.Event()
            done.set()
        return self.wal.synced_bytes

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
            if self.on_failure is not None:
                self.on_failure(exc)

    def _check_failure(self) -> None:
        if self.failure is not None:
            raise JournalFailedError(f"the write-ahead log failed earlier: {self.failure}")

    async def durable(self) -> None:
        """Return once everything applied so far, including the core's own pending
        facts (high-water marks, generation closures), is on disk.

        Raises:
            OSError: the disk refused; the daemon must stop rather than acknowledge.
        """
        self._check_failure()
        self._absorb_core_facts()
        target = self._appended
        while self._durable < target:
            self._check_failure()
            if self._syncing:
                await self._sync_done.wait()
                continue
            self._syncing = True
            try:
                # One scheduling round first: every task already runnable (typically
                # the waiters the previous fsync just released) appends its next fact
                # and joins this group instead of forcing a tiny group of its own.
                if self.group_commit:
                    await trio.lowlevel.checkpoint()
                before, upto = self._durable, self._appended
                groups = (
                    [self.wal.take_pending()]
                    if self.group_commit
                    else self.wal.take_pending_entries()
                )
                for data in groups:
                    started = time.monotonic()
                    try:
                        # Not abandoned on cancellation: an fsync in flight always
                        # completes.
                        await self._disk.run(self.wal.write_durably, data)
                    except Exception as exc:
                        self._fail(exc)
                        raise
                    if self.on_fsync is not None:
                        entries = upto - before if self.group_commit else 1
                        self.on_fsync(time.monotonic() - started, entries)
            finally:
                self._syncing = False
                done, self._sync_done = self._sync_done, trio.Event()
                done.set()
            self._durable = upto
