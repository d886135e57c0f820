"""The commits of every session, applied together: one refresh per scheduling round.

Applying a commit is cheap; re-evaluating its stream afterwards is not (a decision,
perhaps a high-water mark, a new version of our record and its Ed25519 signature),
and with one connection per training process each read holds a single commit.
So each session's reader hands the commits of one read to the daemon's
`CommitBatcher` and waits. The first to hand some in during a scheduling round
leads: it yields once, so that every reader woken by the same round of I/O hands
its commits in too, then applies them all with one
`LocalOperations.submit_commits` (each stream they touch refreshed once) and wakes
the others. Each reader then queues its own replies, in order, and goes on with
its next request: a session's requests still run in the order they came, and
nothing it sent after its commits is served before they are applied.

The outcome of every commit is what applying them one by one, in the order they
were handed in, would give (`Admission.submit_commits`); the replies go through
the session's gated output like any other, so none leaves before the fsync of
the commit it acknowledges.

The wait is shielded from cancellation: commits that were read get applied and
answered, as when a reader applied them inline (a drain lets them finish).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from convergenced.core.facts import Commit
from convergenced.core.local_api_codec import ApiError
from convergenced.daemon.localapi.operations import LocalOperations

Outcome = dict[str, Any] | ApiError
"""The reply of one commit, or its error."""


class _Run:
    """The commits of one read, and their outcomes once applied."""

    __slots__ = ("facts", "outcomes")

    def __init__(self, facts: Sequence[Commit]) -> None:
        self.facts = facts
        self.outcomes: list[Outcome] | None = None


class CommitBatcher:
    """Applies the commits handed in during one scheduling round together."""

    def __init__(self, operations: LocalOperations) -> None:
        self.operations = operations
        self._runs: list[_Run] = []
        self._applied: trio.Event | None = None
        """Set once the runs handed in so far are applied (None: nobody leads)."""

    async def submit(self, facts: Sequence[Commit]) -> list[Outcome]:
        """Apply ``facts`` with those other sessions hand in meanwhile; the outcome
        of each, in order."""
        run = _Run(facts)
        self._runs.append(run)
        with trio.CancelScope(shield=True):
            if self._applied is not None:
                await self._applied.wait()
            else:
                self._applied = applied = trio.Event()
                try:
                    # Every reader already runnable (woken by the same I/O) hands its
                    # commits in before this one comes back.
                    await trio.lowlevel.checkpoint()
                finally:
                    runs, self._runs, self._applied = self._runs, [], None
                try:
                    self._apply(runs)
                finally:
                    applied.set()
        if run.outcomes is None:
            raise RuntimeError("the commits of this read were not applied (see the log)")
        return run.outcomes

    def _apply(self, runs: list[_Run]) -> None:
        if len(runs) == 1:
            runs[0].outcomes = self.operations.submit_commits(runs[0].facts)
            return
        outcomes = self.operations.submit_commits([f for run in runs for f in run.facts])
        at = 0
        for run in runs:
            run.outcomes = outcomes[at : at + len(run.facts)]
            at += len(run.facts)
