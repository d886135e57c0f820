"""Watches: the state of a stream computed once per change, shared by its watchers.

Every change of the node wakes whoever waits for one; with thousands of watches
open, each computing and encoding the full state of its stream, one commit cost
the event loop 131 ms. A `StreamFeed` instead computes the state of one stream
once per change and hands the same `Snapshot`, its msgpack encoding included, to
every watcher of that stream; watchers of a stream that did not change are not
woken at all.

The watch semantics stay those of LOCAL_API.md: a watcher's events each differ
from its previous one (coalescing allowed), and each waits for the fsync of what
it shows. One watcher at a time leads the feed: it waits for the next change,
computes the state and, when it differs from the last snapshot, waits for the
fsync before publishing it to all. Having published, it computes once more before
it waits again, so a change made while the fsync ran is never missed. A leader
that leaves (its client cancels or disconnects) hands the job to the next watcher.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from convergenced.core.packing import pack


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One state of a stream, as every watcher of it is shown it."""

    seq: int
    """1, 2, ...: consecutive snapshots of a feed always differ."""
    state: dict[str, Any]
    packed: bytes
    """``state`` in msgpack, encoded once for every watcher's event."""


class StreamFeed:
    """The snapshots of one stream (see the module docstring)."""

    def __init__(
        self,
        compute: Callable[[], dict[str, Any]],
        changed: Callable[[], Awaitable[None]],
        durable: Callable[[], Awaitable[None]],
    ) -> None:
        """``compute``: the state now; ``changed``: returns after the node's next
        change; ``durable``: returns once everything applied so far is on disk."""
        self._compute = compute
        self._changed = changed
        self._durable = durable
        self.latest: Snapshot | None = None
        self.computed = 0
        """How many times the state was computed (for tests and curiosity)."""
        self.watchers = 0
        self._leading = False
        self._news = trio.Event()

    async def after(self, shown: Snapshot | None) -> Snapshot:
        """The first snapshot whose state differs from ``shown`` (what this watcher
        showed last; None: nothing yet), once it is durable.

        Raises:
            Whatever ``durable`` raises (the log failed).
        """
        while True:
            latest = self.latest
            if latest is not None and latest is not shown:
                # Consecutive snapshots differ; one that skipped some may be back to
                # what this watcher showed (A, B, A): that is no news for it.
                if shown is None or latest.seq == shown.seq + 1 or latest.state != shown.state:
                    return latest
                shown = latest
                continue
            if self._leading:
                await self._news.wait()
                continue
            self._leading = True
            try:
                await self._advance()
            finally:
                self._leading = False
                news, self._news = self._news, trio.Event()
                news.set()  # a new snapshot, or the leader left: either way, look

    async def _advance(self) -> None:
        while True:
            state = self._compute()
            self.computed += 1
            latest = self.latest
            if latest is None or state != latest.state:
                await self._durable()
                seq = 1 if latest is None else latest.seq + 1
                self.latest = Snapshot(seq, state, pack(state))
                return
            await self._changed()
