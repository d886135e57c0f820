"""Frames and the message codec.

A frame is a 12-byte header followed by a msgpack body::

    offset size field
    0      4    magic    b"CVGD"
    4      1    version  protocol version, 1
    5      1    type     MessageType (1 HELLO .. 5 BYE)
    6      2    flags    must be 0 in version 1
    8      4    length   body length in bytes, big-endian, <= max_frame_bytes

Bodies are msgpack maps with string keys (records are arrays, see `records`).
Decoding is strict: every limit of the msgpack unpacker is set explicitly, ext
types and duplicate map keys are refused, every field is type- and range-checked,
unknown and missing fields are errors, and trailing bytes are errors. Each failure
raises `RemoteProtocolError` whose ``reason`` is a short metric label and whose
message names the message and the field path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

from convergenced.core.errors import RemoteProtocolError
from convergenced.core.messages import (
    MESSAGE_TYPES,
    Bye,
    Hello,
    Message,
    MessageType,
    Nudge,
    SummaryEntry,
    Tick,
    Tock,
)
from convergenced.core.packing import (
    UnpackError,
    UnpackLimits,
    pack,
    strict_unpacker,
    unpack_strict,
)
from convergenced.core.records import DIGEST_LEN, Record, name_ok
from convergenced.core.validate import (
    INT64_MAX,
    as_bool,
    as_bytes,
    as_int,
    as_list,
    as_map,
    as_name,
    as_str,
    exact_keys,
)

MAGIC = b"CVGD"
PROTOCOL_VERSION = 2
HEADER = struct.Struct(">4sBBHI")
HEADER_SIZE = HEADER.size
DEFAULT_MAX_FRAME = 1 << 20


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Limits enforced while decoding; every one is explicit and configurable."""

    max_frame_bytes: int = DEFAULT_MAX_FRAME
    max_records: int = 4096
    """Records in one TICK or TOCK."""
    max_summary: int = 65536
    """Entries in one HELLO summary."""
    max_str: int = 1024
    max_bin: int = 1024
    max_array: int = 65536
    max_map: int = 64

    @property
    def unpack(self) -> UnpackLimits:
        """The msgpack unpacker's share of these limits."""
        return UnpackLimits(self.max_str, self.max_bin, self.max_array, self.max_map)


def unpack_body(body: bytes, limits: WireLimits, what: str) -> Any:
    """Decode one msgpack object with every unpacker limit set (see `packing`).

    Raises:
        RemoteProtocolError: reason ``malformed_body`` for anything msgpack refuses,
            duplicate keys, ext types, or trailing bytes.
    """
    try:
        return unpack_strict(body, limits.unpack)
    except UnpackError as exc:
        raise RemoteProtocolError(
            f"{what}: malformed msgpack body ({exc})", reason="malformed_body"
        ) from None


# -- frames -------------------------------------------------------------------


def encode_frame(mtype: MessageType, body: bytes) -> bytes:
    """Header plus body."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(mtype), 0, len(body)) + body


class FrameDecoder:
    """Accumulates bytes and yields complete ``(type, body)`` frames.

    The header is validated as soon as its 12 bytes are in, so an oversized or
    garbage frame is refused before its body is buffered.
    """

    def __init__(self, limits: WireLimits | None = None) -> None:
        self.limits = limits or WireLimits()
        self._buf = bytearray()
        # Bytes fed while nothing was buffered are read in place, without a copy into
        # the buffer: most reads end on a frame boundary. What is left of them (the
        # start of a frame) moves to the buffer when more bytes are needed.
        self._data = b""
        self._pos = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self._buf) + len(self._data) - self._pos

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        if self._pos < len(self._data):
            self._buf += memoryview(self._data)[self._pos :]
        self._data, self._pos = b"", 0
        if self._buf:
            self._buf += data
        else:
            self._data = bytes(data)

    def next_frame(self) -> tuple[MessageType, bytes] | None:
        """The next complete frame, or None until more bytes arrive.

        Raises:
            RemoteProtocolError: bad magic, version, type, flags or length.
        """
        if self._data:
            frame = self._next_in(self._data, self._pos)
            if frame is None:
                # A partial frame: buffered until the rest arrives.
                self._buf += memoryview(self._data)[self._pos :]
                self._data, self._pos = b"", 0
                return None
            self._pos += HEADER_SIZE + len(frame[1])
            if self._pos >= len(self._data):
                self._data, self._pos = b"", 0
            return frame
        frame = self._next_in(self._buf, 0)
        if frame is not None:
            del self._buf[: HEADER_SIZE + len(frame[1])]
        return frame

    def _next_in(self, buf: bytes | bytearray, pos: int) -> tuple[MessageType, bytes] | None:
        have = len(buf) - pos
        if have < HEADER_SIZE:
            # Check what we have of the magic early: a wrong first byte is final.
            n = min(have, 4)
            if buf[pos : pos + n] != MAGIC[:n]:
                raise RemoteProtocolError("frame: bad magic", reason="bad_magic")
            return None
        magic, version, mtype, flags, length = HEADER.unpack_from(buf, pos)
        if magic != MAGIC:
            raise RemoteProtocolError("frame: bad magic", reason="bad_magic")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"frame: protocol version {version} not supported (we speak {PROTOCOL_VERSION})",
                reason="unsupported_version",
            )
        try:
            kind = _TYPES[mtype]
        except KeyError:
            raise RemoteProtocolError(
                f"frame: unknown message type {mtype}", reason="unknown_type"
            ) from None
        if flags:
            raise RemoteProtocolError(f"frame: flags {flags:#x} must be 0", reason="bad_flags")
        if length > self.limits.max_frame_bytes:
            raise RemoteProtocolError(
                f"frame: {kind.name} body of {length} bytes exceeds {self.limits.max_frame_bytes}",
                reason="frame_too_large",
            )
        if have < HEADER_SIZE + length:
            return None
        start = pos + HEADER_SIZE
        return kind, bytes(buf[start : start + length])


_TYPES = {int(t): t for t in MessageType}


# -- messages -----------------------------------------------------------------


def message_to_obj(msg: Message) -> Any:
    """The msgpack-ready body of ``msg``."""
    if isinstance(msg, Hello):
        return {
            "cluster": msg.cluster,
            "node": msg.node,
            "incarnation": msg.incarnation,
            "digest": msg.digest,
            "summary": [list(e) for e in msg.summary],
        }
    if isinstance(msg, Tick | Tock):
        return {
            "seq": msg.seq,
            "digest": msg.digest,
            "match": msg.match,
            "records": [r.to_wire() for r in msg.records],
            "links": list(msg.links),
        }
    if isinstance(msg, Nudge):
        return {}
    return {"reason": msg.reason}


def encode_message(msg: Message) -> bytes:
    """One complete frame for ``msg``.

    TICK and TOCK bodies are assembled from each record's cached packed bytes;
    the result is byte-identical to packing `message_to_obj` (the vectors check).
    """
    if isinstance(msg, Tick | Tock):
        records = msg.records
        body = b"".join(
            [
                _SEQ,
                _packb(msg.seq),
                _DIGEST,
                _packb(msg.digest, use_bin_type=True),
                _MATCH_TRUE if msg.match else _MATCH_FALSE,
                _array_header(len(records)),
                *[r.packed() for r in records],
                _LINKS,
                _packb(list(msg.links), use_bin_type=True),
            ]
        )
        kind = MessageType.TICK if type(msg) is Tick else MessageType.TOCK
        return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, 0, len(body)) + body
    return encode_frame(MESSAGE_TYPES[type(msg)], pack(message_to_obj(msg)))


# The fixed parts of a TICK or TOCK body, in `message_to_obj`'s key order: a map of
# five entries whose keys are short strings (msgpack's canonical encoding of each).
_packb = msgpack.packb
_SEQ: bytes = b"\x85" + _packb("seq")  # the map header (five entries), then "seq"
_DIGEST: bytes = _packb("digest")
_MATCH_TRUE: bytes = _packb("match") + _packb(True)
_MATCH_FALSE: bytes = _packb("match") + _packb(False)
_RECORDS: bytes = _packb("records")
_LINKS: bytes = _packb("links")


def _array_header(n: int) -> bytes:
    """``"records"`` and the array header of ``n`` records, as msgpack packs them."""
    if n < 16:
        return _RECORDS + bytes((0x90 | n,))
    if n < 1 << 16:
        return _RECORDS + b"\xdc" + n.to_bytes(2, "big")
    return _RECORDS + b"\xdd" + n.to_bytes(4, "big")


def decode_message(kind: MessageType, body: bytes, limits: WireLimits | None = None) -> Message:
    """Decode and validate one frame body.

    Raises:
        RemoteProtocolError: naming the message and the field path.
    """
    lim = limits or WireLimits()
    if kind is MessageType.TICK or kind is MessageType.TOCK:
        msg = _decode_exchange(kind, body, lim)
        if msg is not None:
            return msg
    name = kind.name
    obj = unpack_body(body, lim, name)
    return message_from_obj(kind, obj, lim)


# -- the fast path of TICK and TOCK ---------------------------------------------------
#
# Most of what a node receives is the same few records again: every version of a
# record crosses every overlay link, and a relayed record is the same bytes on every
# hop. So a TICK or TOCK is walked without decoding its records: each record's bytes
# are looked up among the records already decoded from exactly those bytes (under the
# same unpacker limits), and only a miss is decoded and validated, strictly, as the
# slow path would. A hit is the same immutable `Record` object, fingerprint and
# packed bytes computed once: a node never pays again for a record another link (or,
# in the simulator, another node) already paid for. The fast path accepts exactly what
# the slow path accepts and returns the same message; anything unusual (a field out
# of place, a bad value, any msgpack error) returns None and the slow path decodes the
# body again, raising the error that names the field.

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


class _Decoded:
    """What one set of unpacker limits has decoded: records, and `links` lists."""

    __slots__ = ("links", "records")

    def __init__(self, capacity: int) -> None:
        self.records: Interned[Record] = Interned(capacity)
        self.links: Interned[tuple[str, ...]] = Interned(capacity)


class _AllDecoded:
    """`_Decoded` per set of unpacker limits (a handful: they come from configuration)."""

    def __init__(self) -> None:
        self.capacity = DECODED_CAPACITY
        self._by_unpack: dict[UnpackLimits, _Decoded] = {}
        self._by_wire: dict[WireLimits, tuple[UnpackLimits, _Decoded]] = {}

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        for d in self._by_unpack.values():
            d.records.resize(self.capacity)
            d.links.resize(self.capacity)

    def get(self, limits: WireLimits) -> tuple[UnpackLimits, _Decoded]:
        found = self._by_wire.get(limits)
        if found is None:
            if len(self._by_wire) >= 16:
                self._by_wire.clear()
            ul = limits.unpack
            d = self._by_unpack.get(ul)
            if d is None:
                d = self._by_unpack[ul] = _Decoded(self.capacity)
            found = self._by_wire[limits] = (ul, d)
        return found


_DECODED = _AllDecoded()


def set_decoded_capacity(capacity: int) -> None:
    """How many records (and link lists) the fast path keeps decoded per set of limits.

    Only memory and speed depend on it, never a decoded value. A daemon keeps the
    default; the simulator, whose nodes share one process and so one cache, raises it
    with the cluster size.
    """
    _DECODED.resize(capacity)


_UNSET: Any = object()


def _decode_exchange(kind: MessageType, body: bytes, lim: WireLimits) -> Tick | Tock | None:
    """A TICK or TOCK body, decoded through the caches above; None: let the strict
    path decode it (it is unusual, or wrong, and that path names the fault)."""
    ul, cache = _DECODED.get(lim)
    seq = digest = match = _UNSET
    records: list[Record] | None = None
    links: tuple[str, ...] | None = None
    try:
        up = strict_unpacker(ul, len(body))
        up.feed(body)
        if up.read_map_header() != 5 or lim.max_map < 5:
            return None
        for _ in range(5):
            key = up.unpack()
            if key == "records":
                count = up.read_array_header()
                if records is not None or count > lim.max_records or count > ul.max_array:
                    return None
                records = []
                interned = cache.records
                for _ in range(count):
                    start = up.tell()
                    up.skip()
                    span = body[start : up.tell()]
                    rec = interned.get(span)
                    if rec is None:
                        rec = _decode_record(span, ul, interned)
                        if rec is None:
                            return None
                    records.append(rec)
            elif key == "links":
                start = up.tell()
                up.skip()
                span = body[start : up.tell()]
                if links is not None:
                    return None
                links = cache.links.get(span)
                if links is None:
                    links = _decode_links(span, ul, cache.links)
                    if links is None:
                        return None
            elif key == "seq" and seq is _UNSET:
                seq = up.unpack()
            elif key == "digest" and digest is _UNSET:
                digest = up.unpack()
            elif key == "match" and match is _UNSET:
                match = up.unpack()
            else:
                return None
        if up.tell() != len(body):
            return None
    except Exception:  # msgpack raises many unrelated types; the strict path sorts it out
        return None
    if (
        records is None
        or links is None
        or len(links) > lim.max_summary
        or type(seq) is not int
        or not 1 <= seq <= INT64_MAX
        or type(digest) is not bytes
        or len(digest) != DIGEST_LEN
        or type(match) is not bool
    ):
        return None
    cls = Tick if kind is MessageType.TICK else Tock
    return cls(seq=seq, digest=digest, match=match, records=tuple(records), links=links)


def _decode_record(span: bytes, ul: UnpackLimits, interned: Interned[Record]) -> Record | None:
    try:
        rec = Record.from_wire(unpack_strict(span, ul), "record")
    except (UnpackError, RemoteProtocolError):
        return None
    # Computed once here rather than by every node that merges or relays it.
    packed = rec.packed()
    rec.fingerprint  # noqa: B018
    # Canonical bytes (any peer of ours sends them) are the key and the cached packing
    # at once; other bytes are a key of their own.
    interned.put(packed if packed == span else span, rec)
    return rec


def _decode_links(
    span: bytes, ul: UnpackLimits, interned: Interned[tuple[str, ...]]
) -> tuple[str, ...] | None:
    try:
        raw = unpack_strict(span, ul)
    except UnpackError:
        return None
    if type(raw) is not list or not all(name_ok(n) for n in raw):
        return None
    links = tuple(raw)
    interned.put(span, links)
    return links


def message_from_obj(kind: MessageType, obj: Any, limits: WireLimits) -> Message:
    """Validate a decoded body (shared by the codec and the golden-vector tests)."""
    name = kind.name
    m = as_map(obj, name, max_len=limits.max_map)
    if kind is MessageType.HELLO:
        exact_keys(m, name, ("cluster", "node", "incarnation", "digest", "summary"))
        raw = as_list(m["summary"], f"{name}.summary", max_len=limits.max_summary)
        summary: list[SummaryEntry] = []
        for i, e in enumerate(raw):
            p = f"{name}.summary[{i}]"
            f = as_list(e, p, max_len=4, length=4)
            summary.append(
                (
                    as_name(f[0], f"{p}.stream"),
                    as_name(f[1], f"{p}.origin"),
                    as_int(f[2], f"{p}.incarnation"),
                    as_int(f[3], f"{p}.version"),
                )
            )
        return Hello(
            cluster=as_name(m["cluster"], f"{name}.cluster"),
            node=as_name(m["node"], f"{name}.node"),
            incarnation=as_int(m["incarnation"], f"{name}.incarnation"),
            digest=_digest(m["digest"], f"{name}.digest"),
            summary=tuple(summary),
        )
    if kind in (MessageType.TICK, MessageType.TOCK):
        exact_keys(m, name, ("seq", "digest", "match", "records", "links"))
        raw = as_list(m["records"], f"{name}.records", max_len=limits.max_records)
        raw_links = as_list(m["links"], f"{name}.links", max_len=limits.max_summary)
        links = tuple(as_name(n, f"{name}.links[{i}]") for i, n in enumerate(raw_links))
        records = tuple(Record.from_wire(r, f"{name}.records[{i}]") for i, r in enumerate(raw))
        cls = Tick if kind is MessageType.TICK else Tock
        return cls(
            seq=as_int(m["seq"], f"{name}.seq", lo=1),
            digest=_digest(m["digest"], f"{name}.digest"),
            match=as_bool(m["match"], f"{name}.match"),
            records=records,
            links=links,
        )
    if kind is MessageType.NUDGE:
        exact_keys(m, name, ())
        return Nudge()
    exact_keys(m, name, ("reason",))
    return Bye(reason=as_str(m["reason"], f"{name}.reason", max_len=256))


def _digest(value: Any, path: str) -> bytes:
    return as_bytes(value, path, min_len=DIGEST_LEN, max_len=DIGEST_LEN)
