"""Incremental aggregation of member records (a segment tree).

Agreement needs, over all members of a stream: the intersection of their
recoverable sets (the convergence interval), the lowest proposal, the lowest
published restore point and the highest published high-water mark. Recomputing
them from scratch costs O(members) per received record, which is O(N^2) work per
round for a large cluster. A segment tree over the members updates in O(log N)
and answers at the root in O(1).

A member without a (spec-matching) record is *missing*: the intersection and the
minima are then unknown (None), never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from convergenced.core.interval_set import IntervalSet


@dataclass(slots=True)
class Summary:
    """The aggregate of a group of members (a leaf is a group of one).

    Immutable by contract (never assigned after construction); not ``frozen=True``
    because every tree update builds several and frozen construction is slow.
    """

    missing: int
    recoverable: IntervalSet | None
    min_proposal: int | None
    min_restore_point: int | None
    max_high_water: int | None
    min_portable: int | None = None
    """The lowest, over the members that have one, of their newest epoch in the shared
    tier (`StreamAgreement.portable`): what a membership change could still need."""

    @staticmethod
    def absent() -> Summary:
        """The leaf of a member we have no record from."""
        return _ABSENT

    @staticmethod
    def neutral() -> Summary:
        """The leaf that changes no aggregate: no member at all."""
        return _EMPTY

    @staticmethod
    def of_member(
        recoverable: IntervalSet,
        proposal: int | None,
        restore_point: int | None,
        high_water: int | None,
        portable: int | None = None,
    ) -> Summary:
        """The leaf of a member with a record."""
        return Summary(0, recoverable, proposal, restore_point, high_water, portable)


_ABSENT = Summary(1, None, None, None, None, None)
_EMPTY = Summary(0, None, None, None, None, None)  # padding leaves: neutral element


def _combine(a: Summary, b: Summary) -> Summary:
    if a is _EMPTY:
        return b
    if b is _EMPTY:
        return a
    ra, rb = a.recoverable, b.recoverable
    rec = None if ra is None or rb is None else ra if ra is rb else ra & rb
    ha, hb = a.max_high_water, b.max_high_water
    pa, pb = a.min_proposal, b.min_proposal
    sa, sb = a.min_restore_point, b.min_restore_point
    qa, qb = a.min_portable, b.min_portable
    return Summary(
        a.missing + b.missing,
        rec,
        None if pa is None or pb is None else pa if pa < pb else pb,
        None if sa is None or sb is None else sa if sa < sb else sb,
        hb if ha is None else ha if hb is None or ha > hb else hb,
        qb if qa is None else qa if qb is None or qa < qb else qb,
    )


def combine(a: Summary, b: Summary) -> Summary:
    """The aggregate of two disjoint groups of members (commutative, associative,
    with `Summary.neutral` as its neutral element)."""
    return _combine(a, b)


class MemberAggregate:
    """Segment tree of `Summary` leaves, one per member, with the root always current."""

    __slots__ = ("_index", "_size", "_tree")

    def __init__(self, members: tuple[str, ...]) -> None:
        self._index = {m: i for i, m in enumerate(members)}
        size = 1
        while size < len(members):
            size *= 2
        self._size = size
        tree = [_EMPTY] * (2 * size)
        for i in range(len(members)):
            tree[size + i] = _ABSENT
        for i in range(size - 1, 0, -1):
            tree[i] = _combine(tree[2 * i], tree[2 * i + 1])
        self._tree = tree

    def set(self, member: str, leaf: Summary) -> None:
        """Replace ``member``'s leaf and update the path to the root."""
        i = self._size + self._index[member]
        tree = self._tree
        if tree[i] is leaf or tree[i] == leaf:
            return
        tree[i] = leaf
        i //= 2
        while i:
            node = _combine(tree[2 * i], tree[2 * i + 1])
            if node == tree[i]:
                return  # nothing above changes either
            tree[i] = node
            i //= 2

    def set_many(self, leaves: list[tuple[str, Summary]]) -> None:
        """Replace many leaves, then recompute each touched inner node once.

        For k updates this costs O(k + k log(N/k)) combines instead of k log N (and
        stops below the root where an inner node comes out as it was).
        """
        if len(leaves) == 1:
            self.set(*leaves[0])
            return
        tree = self._tree
        dirty: set[int] = set()
        for member, leaf in leaves:
            i = self._size + self._index[member]
            old = tree[i]
            if old is not leaf and old != leaf:
                tree[i] = leaf
                dirty.add(i // 2)
        while dirty and 0 not in dirty:
            parents: set[int] = set()
            for i in sorted(dirty):
                node = _combine(tree[2 * i], tree[2 * i + 1])
                if node != tree[i]:
                    tree[i] = node
                    if i > 1:
                        parents.add(i // 2)
            dirty = parents

    def leaf(self, member: str) -> Summary:
        """``member``'s current leaf."""
        return self._tree[self._size + self._index[member]]

    @property
    def root(self) -> Summary:
        """The aggregate over all members."""
        return self._tree[1]
