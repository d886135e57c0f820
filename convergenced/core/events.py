"""What a node reports to its adapter: small frozen events, pulled one at a time.

`NodeCore.next_event` hands them out; the daemon logs and counts them
(`daemon.telemetry`), the simulator checks them against the ground truth.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestorePointChanged:
    """Our restore point moved; ``rollback`` when it moved backwards or vanished."""

    stream: str
    old: int | None
    new: int | None
    rollback: bool


@dataclass(frozen=True, slots=True)
class SpecConflictDetected:
    """A member published a record under a different spec digest."""

    stream: str
    member: str
    digest: bytes


@dataclass(frozen=True, slots=True)
class GenerationResolved:
    """Every member's frozen set of ``generation`` is known; its answer is final."""

    stream: str
    generation: int
    restore_point: int | None


@dataclass(frozen=True, slots=True)
class StateLost:
    """A record of ours from a life this node does not remember arrived: its state
    was lost (or a twin uses its identity). It moved to ``incarnation``, above
    ``seen``, and adopted what that life published (see `lives`)."""

    seen: int
    """The highest incarnation of that life."""
    incarnation: int
    """The incarnation this node runs from now on."""


@dataclass(frozen=True, slots=True)
class MembershipChanged:
    """A job declared a new member map for ``stream`` from generation ``membership``
    on (a spare replaced a host, the job shrank or grew)."""

    stream: str
    membership: int
    left: tuple[str, ...]
    """Members of the previous map that are not in the new one."""
    joined: tuple[str, ...]
    """Members of the new map that were not in the previous one."""
    moved_ranks: tuple[int, ...]
    """Ranks hosted by another node than before (including those of members that left)."""
    replaced: tuple[tuple[str, str], ...] = ()
    """(left, joined) pairs, sorted: a member that left, and one that joined hosting
    some of its ranks (a spare that took over a host)."""


NodeEvent = (
    RestorePointChanged | SpecConflictDetected | GenerationResolved | StateLost | MembershipChanged
)
