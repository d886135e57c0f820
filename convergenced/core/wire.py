"""Frames and the message codec.

A frame is a 12-byte header followed by a msgpack body::

    offset size field
    0      4    magic    b"CVGD"
    4      1    version  protocol version, 2 or 3
    5      1    type     MessageType (1 HELLO .. 5 BYE)
    6      2    flags    must be 0
    8      4    length   body length in bytes, big-endian, <= max_frame_bytes

Bodies are msgpack maps with string keys (records are arrays, see `records`).
Decoding is strict: every limit of the msgpack unpacker is set explicitly, ext
types and duplicate map keys are refused, every field is type- and range-checked,
unknown and missing fields are errors, and trailing bytes are errors. Version 3 is
version 2 plus the ``credentials`` of CA-bound trust (`credentials`): a node reads
frames of either version and sends version 3 only when it uses CA-bound trust, so a
fleet on trust lists keeps talking to nodes that speak only version 2. Each failure
raises `RemoteProtocolError` whose ``reason`` is a short metric label and whose
message names the message and the field path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from convergenced.core.credentials import MAX_CREDENTIAL_BYTES, MAX_CREDENTIALS_PER_MESSAGE
from convergenced.core.decoded_cache import (
    DECODED,
    Interned,
)
from convergenced.core.errors import LocalProtocolError, RemoteProtocolError
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
"""The version sent unless CA-bound trust asks for `CREDENTIALS_VERSION`."""
CREDENTIALS_VERSION = 3
"""Version 2 plus credentials in HELLO, TICK and TOCK."""
VERSIONS = (PROTOCOL_VERSION, CREDENTIALS_VERSION)
"""Versions read."""
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
    max_bin: int = MAX_CREDENTIAL_BYTES
    """The largest bin object: a credential (digests and signatures have exact sizes)."""
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


def encode_frame(mtype: MessageType, body: bytes, version: int = PROTOCOL_VERSION) -> bytes:
    """Header plus body."""
    return HEADER.pack(MAGIC, version, int(mtype), 0, len(body)) + body


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
        self.last_version = PROTOCOL_VERSION
        """The version byte of the frame `next_frame` returned last."""

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
        if version not in VERSIONS:
            raise RemoteProtocolError(
                f"frame: protocol version {version} not supported (we speak "
                f"{' and '.join(map(str, VERSIONS))})",
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
        self.last_version = version
        return kind, bytes(buf[start : start + length])


_TYPES = {int(t): t for t in MessageType}


# -- messages -----------------------------------------------------------------


def message_to_obj(msg: Message, version: int = PROTOCOL_VERSION) -> Any:
    """The msgpack-ready body of ``msg`` in ``version``.

    Raises:
        LocalProtocolError: ``msg`` carries credentials and ``version`` has none.
    """
    if isinstance(msg, Hello | Tick | Tock) and msg.credentials and version < 3:
        raise LocalProtocolError(f"version {version} carries no credentials")
    obj: dict[str, Any]
    if isinstance(msg, Hello):
        obj = {
            "cluster": msg.cluster,
            "node": msg.node,
            "incarnation": msg.incarnation,
            "digest": msg.digest,
            "summary": [list(e) for e in msg.summary],
        }
    elif isinstance(msg, Tick | Tock):
        obj = {
            "seq": msg.seq,
            "digest": msg.digest,
            "match": msg.match,
            "records": [r.to_wire() for r in msg.records],
            "links": list(msg.links),
        }
    elif isinstance(msg, Nudge):
        return {}
    else:
        return {"reason": msg.reason}
    if version >= CREDENTIALS_VERSION:
        obj["credentials"] = list(msg.credentials)
    return obj


def encode_message(msg: Message, version: int = PROTOCOL_VERSION) -> bytes:
    """One complete frame for ``msg``, in protocol ``version`` (2, or 3 with credentials).

    TICK and TOCK bodies are assembled from each record's cached packed bytes;
    the result is byte-identical to packing `message_to_obj` (the vectors check).
    """
    if version not in VERSIONS:
        raise LocalProtocolError(f"protocol version {version} is not spoken here")
    if isinstance(msg, Hello | Tick | Tock) and msg.credentials and version < CREDENTIALS_VERSION:
        raise LocalProtocolError(f"version {version} carries no credentials")
    if isinstance(msg, Tick | Tock) and version == PROTOCOL_VERSION:
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
    if isinstance(msg, Tick | Tock):
        # Version 3: the same fixed parts, then the credentials as a sixth key.
        records = msg.records
        body = b"".join(
            [
                _SEQ6,
                _packb(msg.seq),
                _DIGEST,
                _packb(msg.digest, use_bin_type=True),
                _MATCH_TRUE if msg.match else _MATCH_FALSE,
                _array_header(len(records)),
                *[r.packed() for r in records],
                _LINKS,
                _packb(list(msg.links), use_bin_type=True),
                _CREDENTIALS,
                _packb(list(msg.credentials), use_bin_type=True),
            ]
        )
        kind = MessageType.TICK if type(msg) is Tick else MessageType.TOCK
        return HEADER.pack(MAGIC, version, kind, 0, len(body)) + body
    return encode_frame(MESSAGE_TYPES[type(msg)], pack(message_to_obj(msg, version)), version)


# The fixed parts of a TICK or TOCK body, in `message_to_obj`'s key order: a map of
# five entries whose keys are short strings (msgpack's canonical encoding of each).
_packb = msgpack.packb
_SEQ: bytes = b"\x85" + _packb("seq")  # the map header (five entries), then "seq"
_SEQ6: bytes = b"\x86" + _packb("seq")  # version 3: six entries
_DIGEST: bytes = _packb("digest")
_MATCH_TRUE: bytes = _packb("match") + _packb(True)
_MATCH_FALSE: bytes = _packb("match") + _packb(False)
_RECORDS: bytes = _packb("records")
_LINKS: bytes = _packb("links")
_CREDENTIALS: bytes = _packb("credentials")


def _array_header(n: int) -> bytes:
    """``"records"`` and the array header of ``n`` records, as msgpack packs them."""
    if n < 16:
        return _RECORDS + bytes((0x90 | n,))
    if n < 1 << 16:
        return _RECORDS + b"\xdc" + n.to_bytes(2, "big")
    return _RECORDS + b"\xdd" + n.to_bytes(4, "big")


def decode_message(
    kind: MessageType,
    body: bytes,
    limits: WireLimits | None = None,
    version: int = PROTOCOL_VERSION,
) -> Message:
    """Decode and validate one frame body of protocol ``version``.

    Raises:
        RemoteProtocolError: naming the message and the field path.
    """
    lim = limits or WireLimits()
    if kind is MessageType.TICK or kind is MessageType.TOCK:
        msg = _decode_exchange(kind, body, lim, version)
        if msg is not None:
            return msg
    name = kind.name
    obj = unpack_body(body, lim, name)
    return message_from_obj(kind, obj, lim, version)


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

_UNSET: Any = object()


def _decode_exchange(
    kind: MessageType, body: bytes, lim: WireLimits, version: int
) -> Tick | Tock | None:
    """A TICK or TOCK body, decoded through the caches above; None: let the strict
    path decode it (it is unusual, or wrong, and that path names the fault)."""
    ul, cache = DECODED.get(lim)
    seq = digest = match = _UNSET
    records: list[Record] | None = None
    links: tuple[str, ...] | None = None
    credentials: tuple[bytes, ...] | None = None if version >= CREDENTIALS_VERSION else ()
    keys = 6 if version >= CREDENTIALS_VERSION else 5
    try:
        up = strict_unpacker(ul, len(body))
        up.feed(body)
        if up.read_map_header() != keys or lim.max_map < keys:
            return None
        for _ in range(keys):
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
            elif key == "credentials" and credentials is None:
                credentials = _credentials(up.unpack(), f"{kind.name}.credentials")
            else:
                return None
        if up.tell() != len(body):
            return None
    except Exception:  # msgpack raises many unrelated types; the strict path sorts it out
        return None
    if (
        records is None
        or links is None
        or credentials is None
        or len(links) > lim.max_summary
        or type(seq) is not int
        or not 1 <= seq <= INT64_MAX
        or type(digest) is not bytes
        or len(digest) != DIGEST_LEN
        or type(match) is not bool
    ):
        return None
    cls = Tick if kind is MessageType.TICK else Tock
    return cls(
        seq=seq,
        digest=digest,
        match=match,
        records=tuple(records),
        links=links,
        credentials=credentials,
    )


def _credentials(value: Any, path: str) -> tuple[bytes, ...]:
    """The ``credentials`` of a version 3 message: at most
    `MAX_CREDENTIALS_PER_MESSAGE` opaque byte strings of 1 to `MAX_CREDENTIAL_BYTES`
    each (what they say is for the adapter to judge, `credentials`)."""
    raw = as_list(value, path, max_len=MAX_CREDENTIALS_PER_MESSAGE)
    return tuple(
        as_bytes(c, f"{path}[{i}]", min_len=1, max_len=MAX_CREDENTIAL_BYTES)
        for i, c in enumerate(raw)
    )


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


def message_from_obj(
    kind: MessageType, obj: Any, limits: WireLimits, version: int = PROTOCOL_VERSION
) -> Message:
    """Validate a decoded body of protocol ``version`` (shared by the codec and the
    golden-vector tests)."""
    name = kind.name
    m = as_map(obj, name, max_len=limits.max_map)
    extra: tuple[str, ...] = ("credentials",) if version >= CREDENTIALS_VERSION else ()

    def creds() -> tuple[bytes, ...]:  # after `exact_keys`: present exactly in version 3
        return _credentials(m["credentials"], f"{name}.credentials") if extra else ()

    if kind is MessageType.HELLO:
        exact_keys(m, name, ("cluster", "node", "incarnation", "digest", "summary", *extra))
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
            credentials=creds(),
        )
    if kind in (MessageType.TICK, MessageType.TOCK):
        exact_keys(m, name, ("seq", "digest", "match", "records", "links", *extra))
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
            credentials=creds(),
        )
    if kind is MessageType.NUDGE:
        exact_keys(m, name, ())
        return Nudge()
    exact_keys(m, name, ("reason",))
    return Bye(reason=as_str(m["reason"], f"{name}.reason", max_len=256))


def _digest(value: Any, path: str) -> bytes:
    return as_bytes(value, path, min_len=DIGEST_LEN, max_len=DIGEST_LEN)
