"""Records, their canonical encoding, and the merge that makes views converge.

A node's state for one stream is one *record*, keyed by (stream, origin). Each
record carries the origin's incarnation (bumped at every restart) and version
(bumped at every change). A *view* holds, per key, the record with the highest
``(incarnation, version)``; when two records claim the same pair but differ (an
origin that equivocated, which a correct node never does), the one with the larger
fingerprint wins, and for the same body the larger signature (so a signed copy beats
an unsigned one). That makes `View.merge` a join on a semilattice: commutative,
associative and idempotent, so the order and repetition of deliveries never matter
and any node may relay records unchanged.

The view's *digest* is the XOR of the fingerprints (16 bytes of BLAKE2b over the
canonical body) of all records it holds. XOR keeps it incremental: a merge updates
it in O(1), so links can compare whole views in every message. Records are signed
by their origin (Ed25519, see the security issue) over the same canonical body; the
signature travels beside the body and is not part of the fingerprint.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from convergenced.core.interval_set import IntervalSet
from convergenced.core.limits import MAX_DOMAINS, MAX_GENERATIONS, MAX_NAME_CHARS, MAX_RANGES
from convergenced.core.packing import pack
from convergenced.core.validate import (
    NAME_RE,
    as_bytes,
    as_int,
    as_list,
    as_name,
    as_opt_int,
    fail,
)

RecordKey = tuple[str, str]
"""(stream, origin)."""

SIGNATURE_LEN = 64
DIGEST_LEN = 16
SPEC_DIGEST_LEN = 32


UNDECLARED = bytes(32)
"""The spec digest of a *tombstone*: the record a node publishes when it undeclared
the stream (no SHA-256 of a spec is 32 zero bytes). Members read it as a member that
holds nothing; it never blocks a declaration (PROTOCOL.md 7.4)."""


@dataclass(slots=True, unsafe_hash=True)
class Record:
    """One origin's published state for one stream.

    Immutable by contract: nothing may assign to a field after construction (only
    the two private caches are filled in lazily). It is not ``frozen=True`` because
    a frozen dataclass costs about 2 us more per construction, a third of decoding
    a record off the wire; hashing uses the fields, as a frozen class would.
    """

    stream: str
    origin: str
    incarnation: int
    version: int
    spec_digest: bytes
    recoverable: IntervalSet
    newest: tuple[tuple[str, int], ...] = ()
    """Per domain, the newest epoch every rank of the origin holds there (sorted)."""
    proposal: int | None = None
    restore_point: int | None = None
    high_water: int | None = None
    generations: tuple[tuple[int, IntervalSet], ...] = ()
    """Frozen sets of the origin's open recovery generations (sorted by generation)."""
    membership: int = 0
    """The membership of the origin's spec (`StreamSpec.membership`): tells a member
    that declared another membership of the stream from one in conflict."""
    signature: bytes = b""
    _fingerprint: bytes = field(default=b"", compare=False, repr=False)
    _packed: bytes = field(default=b"", compare=False, repr=False)
    key: RecordKey = field(init=False, compare=False, repr=False)
    """The merge key: (stream, origin)."""
    stamp: tuple[int, int] = field(init=False, compare=False, repr=False)
    """(incarnation, version): what merge compares first."""

    def __post_init__(self) -> None:
        # Built once, not at every use: links and views look records up by key and
        # compare stamps many times per record, and the tuples are shared by every
        # dict that keeps them (a view, a link's known stamps) instead of copied.
        self.key = (self.stream, self.origin)
        self.stamp = (self.incarnation, self.version)

    def body(self) -> list[Any]:
        """The canonical body as a msgpack-ready list (what is signed)."""
        return [
            self.stream,
            self.origin,
            self.incarnation,
            self.version,
            self.spec_digest,
            self.recoverable.encode(),
            [[d, e] for d, e in self.newest],
            self.proposal,
            self.restore_point,
            self.high_water,
            [[g, s.encode()] for g, s in self.generations],
            self.membership,
        ]

    def body_bytes(self) -> bytes:
        """Canonical encoding of `body`."""
        return pack(self.body())

    @property
    def fingerprint(self) -> bytes:
        """16-byte BLAKE2b of the canonical body; cached."""
        if not self._fingerprint:
            fp = hashlib.blake2b(self.body_bytes(), digest_size=DIGEST_LEN).digest()
            self._fingerprint = fp
        return self._fingerprint

    def supersedes(self, other: Record) -> bool:
        """True when this record wins against ``other`` (same key) in a merge."""
        if self.stamp != other.stamp:
            return self.stamp > other.stamp
        if self.fingerprint != other.fingerprint:
            return self.fingerprint > other.fingerprint
        # Same body, different signature (e.g. a signed and an unsigned copy): order
        # them too, so the view's contents, not only its digest, ignore delivery order.
        return self.signature > other.signature

    def generation(self, number: int) -> IntervalSet | None:
        """The origin's frozen set for generation ``number``, if it published one."""
        for g, s in self.generations:
            if g == number:
                return s
        return None

    def to_wire(self) -> list[Any]:
        """Wire form: the body followed by the signature (``b""`` when unsigned)."""
        return [*self.body(), self.signature]

    def packed(self) -> bytes:
        """msgpack encoding of `to_wire`, cached: records are immutable and relayed
        unchanged, so each is packed once however many links it crosses."""
        if not self._packed:
            self._packed = pack(self.to_wire())
        return self._packed

    @classmethod
    def from_wire(cls, obj: Any, path: str) -> Record:
        """Parse and strictly validate the wire form.

        Raises:
            RemoteProtocolError: naming ``path`` and the field at fault.
        """
        fast = _from_wire_fast(obj)
        if fast is not None:
            return fast
        # Something is off: the slow path finds it and names the field.
        f = as_list(obj, path, max_len=13, length=13)
        stream = as_name(f[0], f"{path}.stream")
        origin = as_name(f[1], f"{path}.origin")
        incarnation = as_int(f[2], f"{path}.incarnation")
        version = as_int(f[3], f"{path}.version")
        spec_digest = as_bytes(
            f[4], f"{path}.spec_digest", min_len=SPEC_DIGEST_LEN, max_len=SPEC_DIGEST_LEN
        )
        recoverable = decode_set(f[5], f"{path}.recoverable")
        newest_raw = as_list(f[6], f"{path}.newest", max_len=MAX_DOMAINS)
        newest: list[tuple[str, int]] = []
        for i, pair in enumerate(newest_raw):
            p = as_list(pair, f"{path}.newest[{i}]", max_len=2, length=2)
            newest.append(
                (
                    as_name(p[0], f"{path}.newest[{i}].domain"),
                    as_int(p[1], f"{path}.newest[{i}].epoch"),
                )
            )
        if [d for d, _ in newest] != sorted({d for d, _ in newest}):
            raise fail(f"{path}.newest", "domains not sorted and unique")
        proposal = as_opt_int(f[7], f"{path}.proposal")
        restore_point = as_opt_int(f[8], f"{path}.restore_point")
        high_water = as_opt_int(f[9], f"{path}.high_water")
        gens_raw = as_list(f[10], f"{path}.generations", max_len=MAX_GENERATIONS)
        gens: list[tuple[int, IntervalSet]] = []
        for i, pair in enumerate(gens_raw):
            p = as_list(pair, f"{path}.generations[{i}]", max_len=2, length=2)
            gens.append(
                (
                    as_int(p[0], f"{path}.generations[{i}].generation"),
                    decode_set(p[1], f"{path}.generations[{i}].epochs"),
                )
            )
        if [g for g, _ in gens] != sorted({g for g, _ in gens}):
            raise fail(f"{path}.generations", "generations not sorted and unique")
        membership = as_int(f[11], f"{path}.membership")
        signature = as_bytes(f[12], f"{path}.signature", max_len=SIGNATURE_LEN)
        if signature and len(signature) != SIGNATURE_LEN:
            raise fail(f"{path}.signature", f"expected 0 or {SIGNATURE_LEN} bytes")
        return cls(
            stream, origin, incarnation, version, spec_digest, recoverable,
            tuple(newest), proposal, restore_point, high_water, tuple(gens), membership,
            signature,
        )  # fmt: skip


_I64 = 2**63 - 1
_GOOD_NAMES: set[str] = set()


def name_ok(value: Any) -> bool:
    """Whether ``value`` is a valid name (`validate.NAME_RE`), remembering good ones."""
    if type(value) is not str:
        return False
    if value in _GOOD_NAMES:
        return True
    if len(value) > MAX_NAME_CHARS or not NAME_RE.match(value):
        return False
    if len(_GOOD_NAMES) >= 65_536:  # bounded: names repeat, garbage must not pile up
        _GOOD_NAMES.clear()
    _GOOD_NAMES.add(value)
    return True


def _set_fast(flat: Any) -> IntervalSet | None:
    if type(flat) is not list or len(flat) % 2 or len(flat) > 2 * MAX_RANGES:
        return None
    pairs: list[tuple[int, int]] = []
    prev_hi = -2
    for i in range(0, len(flat), 2):
        lo, hi = flat[i], flat[i + 1]
        if type(lo) is not int or type(hi) is not int:
            return None
        if lo <= prev_hi + 1 or lo > hi or hi > _I64:
            return None
        pairs.append((lo, hi))
        prev_hi = hi
    return IntervalSet._from_normal(tuple(pairs))


def _opt_int_ok(v: Any) -> bool:
    return v is None or (type(v) is int and 0 <= v <= _I64)


def _from_wire_fast(obj: Any) -> Record | None:
    """Decode a well-formed record quickly; None means "let the strict path judge".

    Checks exactly what `Record.from_wire`'s strict path checks, but builds no
    error text, so the common case costs a few microseconds.
    """
    if type(obj) is not list or len(obj) != 13:
        return None
    stream, origin, inc, ver, sd, rec, newest_raw, prop, rp, hw, gens_raw, ms, sig = obj
    if not (name_ok(stream) and name_ok(origin)):
        return None
    if type(inc) is not int or type(ver) is not int or not (0 <= inc <= _I64 and 0 <= ver <= _I64):
        return None
    if type(sd) is not bytes or len(sd) != SPEC_DIGEST_LEN:
        return None
    recoverable = _set_fast(rec)
    if recoverable is None:
        return None
    if type(newest_raw) is not list or len(newest_raw) > MAX_DOMAINS:
        return None
    newest: list[tuple[str, int]] = []
    prev = ""
    for pair in newest_raw:
        if type(pair) is not list or len(pair) != 2:
            return None
        d, e = pair
        if not name_ok(d) or type(e) is not int or not 0 <= e <= _I64 or (newest and d <= prev):
            return None
        prev = d
        newest.append((d, e))
    if not (_opt_int_ok(prop) and _opt_int_ok(rp) and _opt_int_ok(hw)):
        return None
    if type(gens_raw) is not list or len(gens_raw) > MAX_GENERATIONS:
        return None
    gens: list[tuple[int, IntervalSet]] = []
    for pair in gens_raw:
        if type(pair) is not list or len(pair) != 2:
            return None
        g, flat = pair
        epochs = _set_fast(flat)
        if (
            type(g) is not int
            or not 0 <= g <= _I64
            or epochs is None
            or (gens and g <= gens[-1][0])
        ):
            return None
        gens.append((g, epochs))
    if type(ms) is not int or not 0 <= ms <= _I64:
        return None
    if type(sig) is not bytes or len(sig) not in (0, SIGNATURE_LEN):
        return None
    return Record(
        stream,
        origin,
        inc,
        ver,
        sd,
        recoverable,
        tuple(newest),
        prop,
        rp,
        hw,
        tuple(gens),
        ms,
        sig,
    )


def decode_set(obj: Any, path: str) -> IntervalSet:
    """Decode an interval set from its flat wire form, strictly."""
    flat = as_list(obj, path, max_len=2 * MAX_RANGES)
    for i, b in enumerate(flat):
        as_int(b, f"{path}[{i}]")
    try:
        return IntervalSet.decode(flat)
    except ValueError as exc:
        raise fail(path, str(exc)) from None


class View:
    """Everything a node knows: the winning record per (stream, origin).

    `merge` is the only way records enter, and it is a semilattice join.
    """

    __slots__ = ("_by_stream", "_digest", "_log_keys", "_log_seqs", "_records", "_seq")

    def __init__(self) -> None:
        self._records: dict[RecordKey, Record] = {}
        self._by_stream: dict[str, dict[str, Record]] = {}
        self._digest = 0
        # Change log: the sequence number and key of each accepted merge, in two
        # parallel lists (searched and sliced in C), so each link can ask "what
        # changed since I last sent" without scanning the whole view.
        self._seq = 0
        self._log_seqs: list[int] = []
        self._log_keys: list[RecordKey] = []

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self._records.values())

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: RecordKey) -> Record | None:
        """The winning record for ``key``, if any."""
        return self._records.get(key)

    def stream(self, name: str) -> dict[str, Record]:
        """Records of one stream, by origin (read-only by convention)."""
        return self._by_stream.get(name, {})

    def streams(self) -> list[str]:
        """Stream names with at least one record."""
        return sorted(self._by_stream)

    @property
    def digest(self) -> bytes:
        """XOR of all fingerprints: equal views have equal digests."""
        return self._digest.to_bytes(DIGEST_LEN, "big")

    def summary(self) -> dict[RecordKey, tuple[int, int]]:
        """(incarnation, version) per key: what a peer needs to compute our deltas."""
        return {k: r.stamp for k, r in self._records.items()}

    def merge(self, record: Record) -> bool:
        """Keep ``record`` if it supersedes what we hold; return True if it did."""
        key = record.key
        old = self._records.get(key)
        if old is not None:
            # The same object again is the common duplicate (the wire codec shares
            # decoded records): it never supersedes itself.
            if old is record or not record.supersedes(old):
                return False
            self._digest ^= int.from_bytes(old.fingerprint, "big")
        self._digest ^= int.from_bytes(record.fingerprint, "big")
        self._records[key] = record
        by_origin = self._by_stream.get(record.stream)
        if by_origin is None:
            by_origin = self._by_stream[record.stream] = {}
        by_origin[record.origin] = record
        self._seq += 1
        self._log_seqs.append(self._seq)
        self._log_keys.append(key)
        if len(self._log_keys) > 2 * len(self._records) + 64:
            self._compact_log()
        return True

    @property
    def seq(self) -> int:
        """Sequence number of the latest accepted merge (0 for an empty view)."""
        return self._seq

    def changed_since(self, seq: int) -> list[Record]:
        """Current records of the keys changed after sequence number ``seq``."""
        keys = dict.fromkeys(self._log_keys[bisect_right(self._log_seqs, seq) :])
        return list(map(self._records.__getitem__, keys))

    def any_changed_since(
        self,
        seq: int,
        known: dict[RecordKey, tuple[int, int]],
        skip_origins: frozenset[str] = frozenset(),
    ) -> bool:
        """Whether a record changed after ``seq`` is newer than ``known`` says
        (records whose origin is in ``skip_origins`` do not count).

        Scans lazily from the newest change backwards and stops at the first hit, so
        a link that has not sent for a while does not copy the whole log slice.
        """
        seqs, keys = self._log_seqs, self._log_keys
        records = self._records
        for i in range(len(keys) - 1, -1, -1):
            if seqs[i] <= seq:
                return False
            key = keys[i]
            if key[1] in skip_origins:
                continue
            stamp = known.get(key)
            if stamp is None or records[key].stamp > stamp:
                return True
        return False

    def _compact_log(self) -> None:
        latest: dict[RecordKey, int] = {}
        for s, k in zip(self._log_seqs, self._log_keys, strict=True):
            latest[k] = s
        log = sorted((s, k) for k, s in latest.items())
        self._log_seqs = [s for s, _ in log]
        self._log_keys = [k for _, k in log]

    def merge_all(self, records: Iterable[Record]) -> list[Record]:
        """Merge many; return the records that were kept."""
        return [r for r in records if self.merge(r)]

    def newer_than(self, known: dict[RecordKey, tuple[int, int]]) -> list[Record]:
        """Records whose stamp is above what ``known`` says (missing keys count as none)."""
        out = []
        for key, rec in self._records.items():
            stamp = known.get(key)
            if stamp is None or rec.stamp > stamp:
                out.append(rec)
        return out
