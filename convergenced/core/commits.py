"""A commit of an epoch this node may already hold: new, or sent again.

Clients retry: a training process that reconnects after its daemon restarted sends
again every commit it got no answer for, and some of those the daemon had already
made durable. Such a commit must be acknowledged (the rank is waiting for it) and
must change nothing: no second fact in the log, no second count in the metrics.
`judge` tells a commit of (stream, rank, domain, epoch) that the node already holds
from one it does not, from the epoch's `Content` (the digest and size its commit
stated, kept while the epoch is held and through log compaction):

* not held (never committed, or lost or retired since): **new**, applied and logged;
* held, and the commit states the same digest and size, or none at all: a
  **repeat**, acknowledged once what the node holds is durable (its reply goes
  through the output gate like every reply, so it never leaves before the first
  commit's fsync), and applied nowhere;
* held, and the commit states a digest or size that the held one does not: it is
  applied and logged, and its content replaces the held one.

Sans-IO, and shared: `Admission` asks it for the daemon's local API and the
simulator's ranks alike.
"""

from __future__ import annotations

from enum import Enum

from convergenced.core.facts import Commit, StreamFacts


class Verdict(Enum):
    """What a commit is to the node that judges it."""

    NEW = "new"
    """Not held here: apply and log it."""
    REPEAT = "repeat"
    """Held already, and the commit says nothing else: acknowledge it, apply nothing."""
    CONTENT = "content"
    """Held already, with another content (or none): apply and log it."""


def judge(facts: StreamFacts, commit: Commit) -> Verdict:
    """Whether ``commit`` (already checked against ``facts``) is new, a repeat, or
    another content for an epoch held (see the module docstring)."""
    if not facts.holds(commit.rank, commit.domain, commit.epoch):
        return Verdict.NEW
    if not (commit.digest or commit.size):
        return Verdict.REPEAT  # it states nothing the held epoch could contradict
    held = facts.content(commit.rank, commit.domain, commit.epoch)
    if held is not None and held.same(commit.digest, commit.size):
        return Verdict.REPEAT
    return Verdict.CONTENT
