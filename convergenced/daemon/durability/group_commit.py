"""Group commit: where a fact becomes durable, and what lets gated bytes leave.

The daemon applies a fact to its `NodeCore` at once, through the `OutputGate`,
which gives it a position in the log and holds back every byte that may reveal it.
`GroupCommit.durable` is how an adapter waits for a position: it takes the facts
the gate has not logged yet, writes them as one group with one fsync, and tells the
gate what is durable. One write runs at a time, on a disk thread, while the event
loop keeps applying facts: everyone waiting when a write finishes is covered by the
next one, so under load one fsync acknowledges hundreds of commits. With
``one_by_one`` (``wal_group_commit = false``) every entry gets its own write and
fsync, to measure what grouping buys.

**A failed write or fsync poisons the log.** After a failed fsync the kernel may
already have dropped the dirty pages, so a retry can "succeed" without the data
("fsyncgate"). Every later `durable` raises `LogFailedError`; the daemon stops
instead of acknowledging anything more, and the restart replays what is really on
disk.

**Compaction** rewrites the log from the live state once it has grown past a
threshold (`compact_when_due`): the snapshot is taken while no write runs, at the
instant the gate's unlogged facts are dropped (they are all inside it), and the
gate is told everything is durable once the new file is in place.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio

from convergenced import fsutil
from convergenced.core.gate import OutputGate
from convergenced.daemon.durability.entries import Entry
from convergenced.daemon.durability.log_file import FactLog
from convergenced.daemon.telemetry import Telemetry


class Disk(Protocol):
    """Runs the log's blocking calls off the event loop."""

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)``; return its result or raise its error."""

    def close(self) -> None:
        """Stop, after the last call."""


class DiskThread:
    """One long-lived thread for the log's blocking writes, fsyncs and renames.

    Cheaper than `trio.to_thread.run_sync` per fsync (measured here: about 90 us of
    CPU per round trip against 128 us), and it keeps the log's I/O strictly ordered
    on a single thread. `run` never abandons a job: a cancelled caller still waits
    for the disk, because the log must know whether the write happened.
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


class LogFailedError(OSError):
    """A write or fsync of the log failed earlier: nothing can be acknowledged."""


class GroupCommit:
    """Writes what the gate hands it, one group and one fsync at a time."""

    def __init__(
        self,
        log: FactLog,
        gate: OutputGate,
        telemetry: Telemetry,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
        one_by_one: bool = False,
        compact_bytes: int = 64 << 20,
        disk: Disk | None = None,
    ) -> None:
        self.log = log
        self.gate = gate
        self.telemetry = telemetry
        self.on_failure = on_failure
        """Called once, with the error, when a write or fsync fails."""
        self.one_by_one = one_by_one
        self.compact_bytes = compact_bytes
        """Compact once the log grows past this and past twice its last compacted size
        (a log whose live state is large must not be rewritten every few appends)."""
        self.failure: BaseException | None = None
        self._disk: Disk = disk if disk is not None else DiskThread()
        self._writing = False
        """A disk operation runs (one at a time, in order)."""
        self._written = trio.Event()
        """Set (then replaced) each time one ends: wakes every waiter at once, so the
        waiters a write covered all return together, in one scheduling round."""
        self._compacted_size = 0
        self._compaction_due = trio.Event()

    def close(self) -> None:
        """Stop the disk thread (after the last write)."""
        self._disk.close()

    # -- waiting for durability -------------------------------------------------------

    async def durable(self, position: int | None = None) -> None:
        """Return once the log is durable up to ``position`` (default: everything
        applied so far, including the core's own facts).

        Raises:
            LogFailedError: the log failed; the daemon must stop rather than
                acknowledge anything.
        """
        gate = self.gate
        target = gate.position() if position is None else position
        while gate.durable < target:
            self._check_failure()
            if self._writing:
                await self._written.wait()
                continue
            self._begin()
            try:
                # One scheduling round first: every task already runnable (typically
                # the waiters the previous write just released) applies its next fact
                # and joins this group instead of forcing a tiny group of its own.
                if not self.one_by_one:
                    await trio.lowlevel.checkpoint()
                facts, upto = gate.take_unlogged()
                for fact in facts:
                    self.log.append(fact)
                groups = (self.log.take_pending_one_by_one() if self.one_by_one
                          else [self.log.take_pending()])  # fmt: skip
                for data in groups:
                    started = trio.current_time()
                    await self._run(self.log.write_durably, data)
                    entries = 1 if self.one_by_one else len(facts)
                    self.telemetry.log_synced(trio.current_time() - started, entries)
                gate.synced(upto)
            finally:
                self._end()
        if self.compaction_due:
            self._compaction_due.set()

    async def log_now(self, entry: Entry) -> None:
        """Write ``entry`` (one that is not a fact of the node: an incarnation) and
        everything unlogged before it, durably, now."""
        await self._wait_turn()
        try:
            facts, upto = self.gate.take_unlogged()
            for fact in facts:
                self.log.append(fact)
            self.log.append(entry)
            await self._run(self.log.write_durably, self.log.take_pending())
            self.gate.synced(upto)
        finally:
            self._end()

    # -- compaction ------------------------------------------------------------------

    @property
    def compaction_due(self) -> bool:
        """Whether the log has grown past the compaction threshold."""
        return self.log.synced_bytes >= max(self.compact_bytes, 2 * self._compacted_size)

    async def compact(self, snapshot: Callable[[], Sequence[Entry]]) -> int:
        """Rewrite the log as ``snapshot()`` (atomically); return its size in bytes.

        ``snapshot`` must describe everything applied so far (the node's
        `compacted_facts`, with the incarnation first).
        """
        before = self.log.synced_bytes
        started = trio.current_time()
        await self._wait_turn()
        try:
            facts, upto = self.gate.take_unlogged()  # every one of them is in the snapshot
            for fact in facts:
                self.log.append(fact)  # for the old log, should the compaction not happen
            pending = self.log.take_pending()
            try:
                await self._run(self.log.replace_durably, list(snapshot()))
            except fsutil.NotReplaced as exc:
                # Transient (EMFILE, ENOSPC for the new file): the old log goes on
                # with what it lacks, and the next try waits for it to double.
                await self._run(self.log.write_durably, pending)
                self.gate.synced(upto)
                self._compacted_size = max(self._compacted_size, before)
                self.telemetry.log_compaction_deferred(exc)
                return self.log.synced_bytes
            self.gate.synced(upto)
        finally:
            self._end()
        self._compacted_size = size = self.log.synced_bytes
        self.telemetry.log_compacted(before, size, trio.current_time() - started)
        return size

    async def compact_when_due(self, snapshot: Callable[[], Sequence[Entry]]) -> None:
        """Compact whenever a write leaves the log past the threshold (a task)."""
        while True:
            await self._compaction_due.wait()
            self._compaction_due = trio.Event()
            if self.compaction_due and self.failure is None:
                await self.compact(snapshot)

    # -- internals -----------------------------------------------------------------------

    async def _wait_turn(self) -> None:
        while self._writing:
            await self._written.wait()
        self._check_failure()
        self._begin()

    def _begin(self) -> None:
        assert not self._writing
        self._writing = True

    def _end(self) -> None:
        self._writing = False
        done, self._written = self._written, trio.Event()
        done.set()

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Not abandoned on cancellation (see `DiskThread.run`).
        try:
            return await self._disk.run(fn, *args)
        except fsutil.NotReplaced:
            raise  # nothing changed on disk: not a failure of the log
        except Exception as exc:
            if self.failure is None:
                self.failure = exc
                if self.on_failure is not None:
                    self.on_failure(exc)
            raise

    def _check_failure(self) -> None:
        if self.failure is not None:
            raise LogFailedError(f"the write-ahead log failed earlier: {self.failure}")
