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
from typing import Any

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
from convergenced.core.packing import UnpackError, UnpackLimits, pack, unpack_strict
from convergenced.core.records import DIGEST_LEN, Record
from convergenced.core.validate import (
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

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        """Append received bytes."""
        self._buf += data

    def next_frame(self) -> tuple[MessageType, bytes] | None:
        """The next complete frame, or None until more bytes arrive.

        Raises:
            RemoteProtocolError: bad magic, version, type, flags or length.
        """
        if len(self._buf) < HEADER_SIZE:
            # Check what we have of the magic early: a wrong first byte is final.
            n = min(len(self._buf), 4)
            if self._buf[:n] != MAGIC[:n]:
                raise RemoteProtocolError("frame: bad magic", reason="bad_magic")
            return None
        magic, version, mtype, flags, length = HEADER.unpack_from(self._buf)
        if magic != MAGIC:
            raise RemoteProtocolError("frame: bad magic", reason="bad_magic")
        if version != PROTOCOL_VERSION:
            raise RemoteProtocolError(
                f"frame: protocol version {version} not supported (we speak {PROTOCOL_VERSION})",
                reason="unsupported_version",
            )
        try:
            kind = MessageType(mtype)
        except ValueError:
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
        if len(self._buf) < HEADER_SIZE + length:
            return None
        body = bytes(self._buf[HEADER_SIZE : HEADER_SIZE + length])
        del self._buf[: HEADER_SIZE + length]
        return kind, body


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
        packer = msgpack.Packer(use_bin_type=True)
        head = (
            packer.pack_map_header(5)
            + packer.pack("seq") + packer.pack(msg.seq)
            + packer.pack("digest") + packer.pack(msg.digest)
            + packer.pack("match") + packer.pack(msg.match)
            + packer.pack("records") + packer.pack_array_header(len(msg.records))
        )  # fmt: skip
        tail = packer.pack("links") + packer.pack(list(msg.links))
        body = b"".join([head, *(r.packed() for r in msg.records), tail])
        return encode_frame(MESSAGE_TYPES[type(msg)], body)
    return encode_frame(MESSAGE_TYPES[type(msg)], pack(message_to_obj(msg)))


def decode_message(kind: MessageType, body: bytes, limits: WireLimits | None = None) -> Message:
    """Decode and validate one frame body.

    Raises:
        RemoteProtocolError: naming the message and the field path.
    """
    lim = limits or WireLimits()
    name = kind.name
    obj = unpack_body(body, lim, name)
    return message_from_obj(kind, obj, lim)


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
