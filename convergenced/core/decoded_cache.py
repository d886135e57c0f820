"""What the wire codec's fast path has decoded, kept by the exact bytes it came from.

Most of what a node receives is the same few records again (every version of a record
crosses every overlay link, and a relayed record is the same bytes on every hop), so
`wire` looks each record's bytes up here before decoding them. Only memory and speed
depend on these caches, never a decoded value.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from convergenced.core.packing import UnpackLimits
from convergenced.core.records import Record


class WireLimits(Hashable, Protocol):
    """What of `wire.WireLimits` the caches need (named so to keep `wire` out of our
    imports: it imports us)."""

    @property
    def unpack(self) -> UnpackLimits:
        """The msgpack unpacker's limits."""
        ...


__all__ = ["DECODED", "DECODED_CAPACITY", "Interned", "set_decoded_capacity"]

T = TypeVar("T")

DECODED_CAPACITY = 4096
"""Records (and link lists) kept decoded per set of unpacker limits, by default."""


class Interned(Generic[T]):
    """Values decoded from bytes, by those exact bytes; at most ``capacity`` kept.

    Two generations: a lookup tries the young dict, then the old one (and moves a hit
    there up); when the young one holds half the capacity it becomes the old one and
    the previous old one is dropped. Entries in use stay, and a flood of one-off
    values costs at most ``capacity`` entries.
    """

    __slots__ = ("_half", "_old", "_young")

    def __init__(self, capacity: int = DECODED_CAPACITY) -> None:
        self._half = max(1, capacity // 2)
        self._young: dict[bytes, T] = {}
        self._old: dict[bytes, T] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: bytes) -> T | None:
        """The value decoded from ``key``, if kept."""
        value = self._young.get(key)
        if value is None:
            value = self._old.pop(key, None)
            if value is not None:
                self.put(key, value)
        return value

    def put(self, key: bytes, value: T) -> None:
        """Keep ``value`` as decoded from ``key``."""
        if len(self._young) >= self._half:
            self._old = self._young
            self._young = {}
        self._young[key] = value

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` entries from now on (the simulator keeps more)."""
        self._half = max(1, capacity // 2)


class Decoded:
    """What one set of unpacker limits has decoded: records, and `links` lists."""

    __slots__ = ("links", "records")

    def __init__(self, capacity: int) -> None:
        self.records: Interned[Record] = Interned(capacity)
        self.links: Interned[tuple[str, ...]] = Interned(capacity)


class AllDecoded:
    """`_Decoded` per set of unpacker limits (a handful: they come from configuration)."""

    def __init__(self) -> None:
        self.capacity = DECODED_CAPACITY
        self._by_unpack: dict[UnpackLimits, Decoded] = {}
        self._by_wire: dict[WireLimits, tuple[UnpackLimits, Decoded]] = {}

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        for d in self._by_unpack.values():
            d.records.resize(self.capacity)
            d.links.resize(self.capacity)

    def get(self, limits: WireLimits) -> tuple[UnpackLimits, Decoded]:
        found = self._by_wire.get(limits)
        if found is None:
            if len(self._by_wire) >= 16:
                self._by_wire.clear()
            ul = limits.unpack
            d = self._by_unpack.get(ul)
            if d is None:
                d = self._by_unpack[ul] = Decoded(self.capacity)
            found = self._by_wire[limits] = (ul, d)
        return found


DECODED = AllDecoded()
"""The one cache of the process (the wire codec's)."""


def set_decoded_capacity(capacity: int) -> None:
    """How many records (and link lists) the fast path keeps decoded per set of limits.

    Only memory and speed depend on it, never a decoded value. A daemon keeps the
    default; the simulator, whose nodes share one process and so one cache, raises it
    with the cluster size.
    """
    DECODED.resize(capacity)
