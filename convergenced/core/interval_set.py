"""Sets of epochs as normalized, sorted, disjoint, inclusive ranges.

Recoverable sets are mostly long runs (a rank commits epoch after epoch), so a set
is stored as a tuple of ``(lo, hi)`` pairs with ``lo <= hi``, sorted, and with a gap
of at least one epoch between neighbours (adjacent ranges are merged). That normal
form makes equality structural and the encoding canonical: the same set always has
the same bytes, which the record digests rely on.

Instances are immutable and hashable. Every operation is linear in the number of
ranges.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from convergenced.core.limits import MAX_INT

MAX_EPOCH = MAX_INT
"""Epochs are non-negative and fit a signed 64-bit integer (msgpack int64)."""


class IntervalSet:
    """An immutable set of non-negative integer epochs."""

    __slots__ = ("_hash", "_ranges")

    _ranges: tuple[tuple[int, int], ...]
    _hash: int | None

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        """Build a set from ranges in any order; overlapping/adjacent ones merge.

        Raises:
            ValueError: a range has ``lo > hi`` or a bound outside ``[0, MAX_EPOCH]``.
        """
        pairs = sorted(ranges)
        for lo, hi in pairs:
            if not (0 <= lo <= hi <= MAX_EPOCH):
                raise ValueError(f"invalid epoch range ({lo}, {hi})")
        merged: list[tuple[int, int]] = []
        for lo, hi in pairs:
            if merged and lo <= merged[-1][1] + 1:
                if hi > merged[-1][1]:
                    merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        self._ranges = tuple(merged)
        self._hash = None

    @classmethod
    def _from_normal(cls, ranges: tuple[tuple[int, int], ...]) -> IntervalSet:
        obj = cls.__new__(cls)
        obj._ranges = ranges
        obj._hash = None
        return obj

    @classmethod
    def of(cls, *epochs: int) -> IntervalSet:
        """The set holding exactly these epochs."""
        return cls((e, e) for e in epochs)

    @classmethod
    def span(cls, lo: int, hi: int) -> IntervalSet:
        """All epochs from ``lo`` to ``hi`` inclusive (empty when ``lo > hi``)."""
        return cls() if lo > hi else cls([(lo, hi)])

    # -- inspection ---------------------------------------------------------

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """The normalized ranges, sorted and disjoint."""
        return self._ranges

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def __len__(self) -> int:
        """Number of epochs in the set (not the number of ranges)."""
        return sum(hi - lo + 1 for lo, hi in self._ranges)

    def __iter__(self) -> Iterator[int]:
        for lo, hi in self._ranges:
            yield from range(lo, hi + 1)

    def __contains__(self, epoch: object) -> bool:
        if not isinstance(epoch, int):
            return False
        rs = self._ranges
        if not rs:
            return False
        lo, hi = rs[-1]  # the commit path asks about the newest epochs: the last range
        if epoch >= lo:
            return epoch <= hi
        lo_i, hi_i = 0, len(rs) - 1
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            lo, hi = rs[mid]
            if epoch < lo:
                hi_i = mid
            elif epoch > hi:
                lo_i = mid + 1
            else:
                return True
        return False

    def min(self) -> int | None:
        """The smallest epoch, or None when empty."""
        return self._ranges[0][0] if self._ranges else None

    def max(self) -> int | None:
        """The largest epoch, or None when empty."""
        return self._ranges[-1][1] if self._ranges else None

    def max_at_most(self, bound: int) -> int | None:
        """The largest epoch ``<= bound``, or None."""
        best: int | None = None
        for lo, hi in self._ranges:
            if lo > bound:
                break
            best = min(hi, bound)
        return best

    def newest_ranges(self, limit: int) -> IntervalSet:
        """The set cut to its ``limit`` newest ranges (itself when it has no more)."""
        if len(self._ranges) <= limit:
            return self
        return IntervalSet._from_normal(self._ranges[len(self._ranges) - limit :])

    # -- single epochs (the commit path) --------------------------------------

    def add(self, epoch: int) -> IntervalSet:
        """This set plus ``epoch``; O(log n) search, and O(1) work for the usual
        case of the next epoch in sequence.

        Raises:
            ValueError: ``epoch`` outside ``[0, MAX_EPOCH]``.
        """
        if not 0 <= epoch <= MAX_EPOCH:
            raise ValueError(f"invalid epoch {epoch}")
        rs = self._ranges
        if rs and epoch == rs[-1][1] + 1:  # the common case: the next epoch
            return IntervalSet._from_normal((*rs[:-1], (rs[-1][0], epoch)))
        i = self._index_after(epoch)  # first range with lo > epoch
        if i and rs[i - 1][1] >= epoch:
            return self  # already present
        lo, hi = epoch, epoch
        start, end = i, i
        if i and rs[i - 1][1] + 1 == epoch:
            lo = rs[i - 1][0]
            start = i - 1
        if i < len(rs) and rs[i][0] == epoch + 1:
            hi = rs[i][1]
            end = i + 1
        return IntervalSet._from_normal((*rs[:start], (lo, hi), *rs[end:]))

    def remove(self, epoch: int) -> IntervalSet:
        """This set without ``epoch``."""
        rs = self._ranges
        i = self._index_after(epoch) - 1
        if i < 0 or rs[i][1] < epoch:
            return self
        lo, hi = rs[i]
        middle: list[tuple[int, int]] = []
        if lo < epoch:
            middle.append((lo, epoch - 1))
        if epoch < hi:
            middle.append((epoch + 1, hi))
        return IntervalSet._from_normal((*rs[:i], *middle, *rs[i + 1 :]))

    def _index_after(self, epoch: int) -> int:
        rs = self._ranges
        lo_i, hi_i = 0, len(rs)
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            if rs[mid][0] > epoch:
                hi_i = mid
            else:
                lo_i = mid + 1
        return lo_i

    # -- algebra ------------------------------------------------------------

    def union(self, other: IntervalSet) -> IntervalSet:
        """Epochs in either set."""
        if not other._ranges:
            return self
        if not self._ranges:
            return other
        return IntervalSet(self._ranges + other._ranges)

    def intersection(self, other: IntervalSet) -> IntervalSet:
        """Epochs in both sets."""
        a, b = self._ranges, other._ranges
        if not a or not b:
            return EMPTY
        if len(a) == 1 and len(b) == 1:
            lo, hi = max(a[0][0], b[0][0]), min(a[0][1], b[0][1])
            if lo > hi:
                return EMPTY
            if (lo, hi) == a[0]:
                return self
            return other if (lo, hi) == b[0] else IntervalSet._from_normal(((lo, hi),))
        i = j = 0
        out: list[tuple[int, int]] = []
        while i < len(a) and j < len(b):
            lo = max(a[i][0], b[j][0])
            hi = min(a[i][1], b[j][1])
            if lo <= hi:
                out.append((lo, hi))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return IntervalSet._from_normal(tuple(out))

    def difference(self, other: IntervalSet) -> IntervalSet:
        """Epochs in this set and not in ``other``."""
        if not other._ranges or not self._ranges:
            return self
        out: list[tuple[int, int]] = []
        b = other._ranges
        j = 0
        for lo, hi in self._ranges:
            cur = lo
            while j < len(b) and b[j][1] < cur:
                j += 1
            k = j
            while k < len(b) and b[k][0] <= hi:
                if b[k][0] > cur:
                    out.append((cur, b[k][0] - 1))
                cur = max(cur, b[k][1] + 1)
                if cur > hi:
                    break
                k += 1
            if cur <= hi:
                out.append((cur, hi))
        return IntervalSet._from_normal(tuple(out))

    def below(self, bound: int) -> IntervalSet:
        """Epochs strictly below ``bound`` (any integer; no epoch exceeds `MAX_EPOCH`)."""
        if bound > MAX_EPOCH:
            return self
        return self.intersection(IntervalSet.span(0, bound - 1)) if bound > 0 else IntervalSet()

    def at_least(self, bound: int) -> IntervalSet:
        """Epochs ``>= bound``."""
        return self.intersection(IntervalSet.span(max(bound, 0), MAX_EPOCH))

    __or__ = union
    __and__ = intersection
    __sub__ = difference

    @staticmethod
    def intersect_all(sets: Sequence[IntervalSet]) -> IntervalSet:
        """Intersection of a non-empty sequence of sets.

        Raises:
            ValueError: ``sets`` is empty (the intersection of nothing is undefined here).
        """
        if not sets:
            raise ValueError("intersection of no sets")
        acc = sets[0]
        for s in sets[1:]:
            if not acc:
                break
            acc = acc & s
        return acc

    @staticmethod
    def union_all(sets: Iterable[IntervalSet]) -> IntervalSet:
        """Union of any number of sets."""
        pairs: list[tuple[int, int]] = []
        for s in sets:
            pairs.extend(s._ranges)
        return IntervalSet(pairs)

    # -- encoding -----------------------------------------------------------

    def encode(self) -> list[int]:
        """Compact canonical form: a flat list ``[lo0, hi0, lo1, hi1, ...]``."""
        return [bound for pair in self._ranges for bound in pair]

    @classmethod
    def decode(cls, flat: Sequence[int]) -> IntervalSet:
        """Inverse of `encode`; accepts only the canonical form.

        Raises:
            ValueError: odd length, a bound that is not an int (bools and floats
                included) or out of range, or ranges not sorted, disjoint and
                separated by a gap.
        """
        if len(flat) % 2:
            raise ValueError("odd number of bounds")
        for bound in flat:
            if type(bound) is not int:
                raise ValueError(f"bound {bound!r} is not an integer")
        pairs = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
        prev_hi = -2
        for lo, hi in pairs:
            if not (0 <= lo <= hi <= MAX_EPOCH):
                raise ValueError(f"invalid epoch range ({lo}, {hi})")
            if lo <= prev_hi + 1:
                raise ValueError("ranges not sorted, disjoint and separated")
            prev_hi = hi
        return cls._from_normal(pairs)

    # -- dunder -------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntervalSet) and self._ranges == other._ranges

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._ranges)
        return self._hash

    def __repr__(self) -> str:
        parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self._ranges]
        return "IntervalSet{" + ", ".join(parts) + "}"


EMPTY = IntervalSet()
"""The empty set (shared: instances are immutable)."""
