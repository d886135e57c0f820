"""Agreement on a stream: convergence interval, proposal, restore point, GC horizon.

The rules, exactly as DESIGN.md section 2 defines them, for one node's view:

* **Convergence interval** CI: the intersection of every member's recoverable set.
  Unknown (None) until we hold a record of every member with our spec digest.
* **Proposal**: max(CI) as this node sees it. Published in our record (phase one).
* **Restore point** (phase two): the newest e in CI that every member has proposed,
  i.e. ``max(CI ∩ [0, min proposal])``. It never moves backwards (S3) while it
  stays in CI. When it drops out of CI (a retraction somewhere) the node *rolls
  back*: it takes the best candidate again, but never one below the *rollback
  floor* ``max(high_water of any member) - retention``.
* **High-water mark**: the highest restore point a node ever published; made
  durable before the record carrying it leaves the node.
* **GC horizon** H: ``min(published restore point of every member) - retention``,
  and, when the policy can be met from shared domains alone, at most ``min(newest
  epoch in the shared tier of each member that has one) - retention``: a member whose
  host dies can only be restored from there, so that epoch stays everywhere (the
  *portable cap*). Epochs below H are safe to delete, except those in a frozen set of
  an open recovery generation.

Why the floor keeps S1 (validity) through rollbacks: a node B deletes e only when
e < H_B <= rp_A - retention for the rp_A that B saw A publish, and rp_A <= hw_A.
So nothing at or above ``hw_A - retention`` was deleted anywhere, and a rollback
that stays at or above it can only land on an epoch nobody retired. Frozen sets
are cut at the same floor, which is what makes S4 hold without coordination.

Knowledge levels say how far the node got; common knowledge is impossible, so the
daemon reports the level it reached instead of pretending.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

from convergenced.core.aggregate import MemberAggregate, Summary, combine
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import UNDECLARED, Record
from convergenced.core.spec import PolicyMode, StreamSpec


class Knowledge(IntEnum):
    """How much a node knows about its restore point (higher is more)."""

    INCOMPLETE = 0
    """Some member's record is missing (or conflicts): the interval is unknown."""
    INTERVAL = 1
    """Every member's recoverable set is known: the convergence interval is."""
    PROPOSED = 2
    """Every member proposed at least the restore point: all can restore it."""
    PUBLISHED = 3
    """Every member published a restore point at least ours: all know it is agreed."""


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of one evaluation of the rules for our own node."""

    convergence: IntervalSet | None
    proposal: int | None
    restore_point: int | None
    high_water: int | None
    rollback: bool
    floor: int | None
    knowledge: Knowledge


class StreamAgreement:
    """The member aggregate of one stream and the rules evaluated over it."""

    def __init__(self, spec: StreamSpec, me: str) -> None:
        self.spec = spec
        self.me = me
        self.digest = spec.digest
        self.members = frozenset(spec.member_ids)
        # The tree holds the other members; our own leaf, which every evaluation
        # replaces (three times), is kept beside it and combined with its root.
        self.aggregate = MemberAggregate(spec.member_ids)
        self._mine = Summary.absent() if me in self.members else Summary.neutral()
        if me in self.members:
            self.aggregate.set(me, Summary.neutral())
        self.conflicts: dict[str, bytes] = {}
        self.fresh_from: dict[str, tuple[int, int]] = {}
        """Per member, the oldest record stamp we may use (see `facts.HighWater`)."""
        self._shared = [d for d in spec.policy.domains if spec.is_shared(d)]
        """The policy's shared domains (`portable` asks for every record observed)."""

    def observe_many(self, records: list[Record]) -> list[Record]:
        """Take (winning) records of other members into the aggregate, in one tree
        update; return the records that brought a new spec conflict."""
        leaves: list[tuple[str, Summary]] = []
        conflicts: list[Record] = []
        for record in records:
            leaf = self._leaf(record, conflicts)
            if leaf is not None:
                leaves.append((record.origin, leaf))
        self.aggregate.set_many(leaves)
        return conflicts

    def _leaf(self, record: Record, conflicts: list[Record]) -> Summary | None:
        origin = record.origin
        if origin not in self.members or origin == self.me:
            return None
        if record.spec_digest == UNDECLARED:
            # The member undeclared the stream: it holds nothing (`declarations`).
            self.conflicts.pop(origin, None)
            return Summary.of_member(IntervalSet(), None, None, None)
        if record.spec_digest != self.digest:
            if record.membership != self.spec.membership:
                # Another membership of the stream (it is on an older one, or we are):
                # not evidence about this member map, and no conflict either.
                self.conflicts.pop(origin, None)
                return Summary.absent()
            if origin not in self.conflicts:
                conflicts.append(record)
            self.conflicts[origin] = record.spec_digest
            return Summary.absent()
        self.conflicts.pop(origin, None)
        floor = self.fresh_from.get(origin)
        if floor is not None and record.stamp < floor:
            # Older than what justified our high-water mark: stale, not evidence.
            return Summary.absent()
        return Summary.of_member(
            record.recoverable,
            record.proposal,
            record.restore_point,
            record.high_water,
            self.portable(record.newest),
        )

    def portable(self, newest: Iterable[tuple[str, int]]) -> int | None:
        """The newest epoch a member's ranks could restore after moving to another
        host, from its ``newest`` epoch per domain: in the shared domains of the
        policy only (any of them, or all when the policy needs all, which only counts
        when every domain of the policy is shared). None: nothing would survive."""
        policy = self.spec.policy
        shared = self._shared
        if not shared:
            return None
        by_domain = dict(newest)
        held = [by_domain[d] for d in shared if d in by_domain]
        if policy.mode is PolicyMode.ANY:
            return max(held, default=None)
        if len(shared) < len(policy.domains) or len(held) < len(shared):
            return None
        return min(held)

    def decide(
        self,
        recoverable: IntervalSet,
        previous_rp: int | None,
        previous_proposal: int | None,
        high_water: int | None,
        newest: Iterable[tuple[str, int]] = (),
    ) -> Decision:
        """Evaluate the rules with our own fresh recoverable set (and ``newest`` epoch
        per domain, for the portable cap of the GC horizon)."""
        others = self.aggregate.root
        portable = self.portable(newest)
        root = combine(
            Summary.of_member(recoverable, previous_proposal, previous_rp, high_water, portable),
            others,
        )
        ci = root.recoverable if root.missing == 0 and not self.conflicts else None
        proposal = ci.max() if ci is not None else None
        root = combine(
            Summary.of_member(recoverable, proposal, previous_rp, high_water, portable), others
        )

        best = None
        if ci is not None and root.min_proposal is not None:
            best = ci.max_at_most(root.min_proposal)
        floor = None
        if root.max_high_water is not None:
            floor = max(root.max_high_water - self.spec.retention, 0)

        rollback = False
        if previous_rp is not None and (ci is None or previous_rp in ci):
            # Still valid (or nothing new is known): never move backwards.
            rp: int | None = previous_rp if best is None or best < previous_rp else best
        else:
            # First restore point, or the previous one was lost to a retraction.
            rp = best if best is not None and (floor is None or best >= floor) else None
            rollback = previous_rp is not None and (rp is None or rp < previous_rp)

        new_hw = high_water
        if rp is not None and (high_water is None or rp > high_water):
            new_hw = rp
        self._mine = Summary.of_member(recoverable, proposal, rp, new_hw, portable)
        root = combine(self._mine, others)

        if ci is None:
            knowledge = Knowledge.INCOMPLETE
        elif rp is None or root.min_proposal is None or root.min_proposal < rp:
            knowledge = Knowledge.INTERVAL
        elif root.min_restore_point is not None and root.min_restore_point >= rp:
            knowledge = Knowledge.PUBLISHED
        else:
            knowledge = Knowledge.PROPOSED
        return Decision(ci, proposal, rp, new_hw, rollback, floor, knowledge)

    def gc_horizon(self) -> int | None:
        """Epochs below this are safe to delete (minus frozen sets); None: nothing is."""
        root = combine(self._mine, self.aggregate.root)
        if root.missing or self.conflicts or root.min_restore_point is None:
            return None
        horizon = root.min_restore_point
        if root.min_portable is not None:
            horizon = min(horizon, root.min_portable)  # the portable cap (see above)
        return max(horizon - self.spec.retention, 0)
