"""The local API codec: what training processes and `convergencectl` say to their daemon.

Sans-IO, shared by the daemon (trio) and the clients (plain sockets or trio). The
full description, with examples, is in ``proto/LOCAL_API.md``.

**Framing.** Each message is a big-endian ``u32`` length followed by that many bytes
of msgpack holding one map. A length above the reader's limit is refused before any
byte of the body is buffered.

**Decoding costs what the bytes say, no more.** Building a msgpack object costs
far more than reading its bytes (a frame of a million empty maps took 0.2 s of the
daemon's event loop), so the reader refuses, before building anything, a body that
is not a map (every message is one) and, with a `DecodeBudget`, a body holding
more objects, or more maps and arrays, than any request can legitimately hold: the
largest is a declaration of ``limits.max_members`` members. Small frames cannot
hold that many and are not even scanned.

**Requests** are ``{"id": uint, "op": str, "args": map}``. The id is the client's
choice; replies carry it back, so one connection can have many requests in flight.

**Replies** are one of::

    {"id": 7, "ok": <result>}
    {"id": 7, "error": {"kind": "rejected", "reason": "unknown_stream", "message": "..."}}
    {"id": 7, "event": <result>}        # watch only: one per change, until cancelled

The error ``kind`` says whose move it is (`ErrorKind`); ``reason`` is a short stable
label (the same the daemon counts in its metrics); ``message`` is for humans and
names the offending field.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from convergenced.core.limits import MAX_RANKS_PER_MEMBER
from convergenced.core.local_api_errors import ApiError, ErrorKind, bad_request
from convergenced.core.local_api_requests import (
    MAX_TIMEOUT_S,
    OPS,
    Request,
    parse_request,
    request,
)
from convergenced.core.packing import UnpackError, UnpackLimits, pack, unpack_strict

__all__ = [
    "DEFAULT_MAX_FRAME",
    "LENGTH",
    "MAX_TIMEOUT_S",
    "OPS",
    "ApiError",
    "DecodeBudget",
    "ErrorKind",
    "FrameEncoder",
    "FrameReader",
    "Request",
    "bad_request",
    "encode_frame",
    "error",
    "error_from_wire",
    "event",
    "event_frame",
    "ok",
    "parse_request",
    "request",
]

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20


def encode_frame(obj: Any) -> bytes:
    """One framed message."""
    body = pack(obj)
    return LENGTH.pack(len(body)) + body


class FrameEncoder:
    """`encode_frame` with a msgpack packer of its own, reused from frame to frame.

    The same bytes (`packing.pack`'s canonical settings); making a packer costs about
    as much as packing a small reply, which counts at tens of thousands of frames a
    second. Not for sharing between threads: one per connection or per event loop.
    """

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, obj: Any) -> bytes:
        """One framed message, as `encode_frame`."""
        body: bytes = self._packer.pack(obj)
        return LENGTH.pack(len(body)) + body


@dataclass(frozen=True, slots=True)
class DecodeBudget:
    """The most one frame may make the decoder build."""

    max_objects: int
    """msgpack objects of any kind, containers included."""
    max_containers: int
    """Maps and arrays: each costs the decoder a dozen times what a number does."""

    @classmethod
    def for_requests(cls, max_members: int) -> DecodeBudget:
        """What the largest legitimate request holds, with room to spare.

        That is a declaration of ``max_members`` members (a name and a list of ranks
        each), hosting 16 ranks each on average, or `MAX_RANKS_PER_MEMBER` ranks in
        all, whichever is more. Below 256 members the budget stays that of 256, so a
        declaration over a small ``max_members`` is still read and refused by name
        (``too_many_members``).
        """
        members = max(max_members, 256)
        ranks = max(MAX_RANKS_PER_MEMBER, 16 * members)
        return cls(max_objects=256 + 2 * members + ranks, max_containers=64 + 2 * members)


_MAP_HEADERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_SCALAR_BYTES = [0] * 256
"""Total size of an object of fixed size, by its first byte (0: not fixed)."""
for _b in [*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3]:
    _SCALAR_BYTES[_b] = 1
for _b in range(0xA0, 0xC0):
    _SCALAR_BYTES[_b] = 1 + (_b & 0x1F)  # fixstr
_FIXED = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3,
          0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}  # fmt: skip
for _b, _n in _FIXED.items():
    _SCALAR_BYTES[_b] = _n
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0),
          0xDB: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}  # fmt: skip
"""bin, str and ext: (bytes of the length, bytes after it before the payload)."""
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
"""array and map 16/32: (bytes of the count, objects per counted entry)."""


def _over_budget(body: bytes, budget: DecodeBudget) -> str | None:
    """Why ``body`` would cost more than ``budget`` to decode, or None.

    Walks the msgpack headers without building anything and stops as soon as the
    declared contents pass the budget. Bytes that are not msgpack end the walk
    quietly: the decoder then says what is wrong with them.
    """
    scalar_bytes, sized, counted = _SCALAR_BYTES, _SIZED, _CONTAINERS  # locals: a hot loop
    max_objects, max_containers = budget.max_objects, budget.max_containers
    pos, end, todo, objects, containers = 0, len(body), 1, 0, 0
    while todo and pos < end:
        b = body[pos]
        todo -= 1
        objects += 1
        if step := scalar_bytes[b]:
            pos += step
            continue
        if b <= 0x9F:  # fixmap (two objects an entry), fixarray
            n = (b & 0x0F) << (b <= 0x8F)
            pos += 1
        elif b in counted:
            size, per = counted[b]
            n = int.from_bytes(body[pos + 1 : pos + 1 + size], "big") * per
            pos += 1 + size
        elif b in sized:
            size, extra = sized[b]
            pos += 1 + size + extra + int.from_bytes(body[pos + 1 : pos + 1 + size], "big")
            continue
        else:
            return None  # 0xc1, never used by msgpack
        containers += 1
        todo += n
        if containers > max_containers:
            return f"more than {max_containers} maps and arrays"
        if objects + todo > max_objects:
            return f"more than {max_objects} objects"
    return None


class FrameReader:
    """Splits a byte stream into decoded messages, with explicit limits.

    A bad frame (oversized or undecodable) ends the stream: it cannot be
    resynchronized. The messages decoded before it in the same read are still
    returned; the error is then in `failed`, and raised by the next `feed`.
    """

    def __init__(
        self,
        max_frame: int = DEFAULT_MAX_FRAME,
        *,
        max_items: int = 65536,
        budget: DecodeBudget | None = None,
    ) -> None:
        self.max_frame = max_frame
        self.max_items = max_items
        self.budget = budget
        """What one frame may hold (None: only the length limits of the unpacker)."""
        self._limits = UnpackLimits(max_items * 16, max_items * 16, max_items, max_items)
        self._buf = bytearray()
        self.failed: ApiError | None = None
        """The error that ended the stream, once one did."""

    def feed(self, data: bytes) -> list[Any]:
        """Add ``data``; return every complete message before any bad frame.

        Raises:
            ApiError: ``bad_request`` when the bad frame is the first thing left to
                read (check `failed` after handling what an earlier call returned).
        """
        out: list[Any] = []
        try:
            for body in self.split(data):
                out.append(self.decode(body))
        except ApiError:
            if not out:
                raise
        return out

    def split(self, data: bytes) -> list[bytes]:
        """Add ``data``; return the body of every complete frame, not decoded yet
        (`decode` each in turn). A frame too large ends the stream: the bodies
        before it are returned and the error is in `failed`.

        Raises:
            ApiError: ``frame_too_large`` when no body comes before it, or the
                stream had already failed.
        """
        if self.failed is not None:
            raise self.failed
        # Frames are cut from ``data`` itself when nothing was left over (the usual
        # case: one copy per body), else from the buffer, which is cut once per call.
        buf: bytes | bytearray = data
        if self._buf:
            self._buf += data
            buf = self._buf
        out: list[bytes] = []
        pos, end, head, limit = 0, len(buf), LENGTH.size, self.max_frame
        while end - pos >= head:
            (n,) = LENGTH.unpack_from(buf, pos)
            if n > limit:
                err = self._end(
                    bad_request(
                        f"frame of {n} bytes above the limit of {limit}",
                        "frame_too_large",
                    )
                )
                if not out:
                    raise err
                return out
            if end - pos - head < n:
                break
            out.append(bytes(buf[pos + head : pos + head + n]))
            pos += head + n
        if buf is data:
            self._buf[:] = data[pos:]
        else:
            del self._buf[:pos]
        return out

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held so far."""
        return len(self._buf)

    def decode(self, body: bytes) -> Any:
        """The message in one frame's ``body``.

        Raises:
            ApiError: ``undecodable`` (not one strict msgpack map) or
                ``too_many_objects`` (more than the budget); either ends the stream.
        """
        if not body or body[0] not in _MAP_HEADERS:
            what = f"begins with 0x{body[0]:02x}" if body else "is empty"
            raise self._end(
                bad_request(
                    f"undecodable frame: a message is one msgpack map, this body {what}",
                    "undecodable",
                )
            )
        budget = self.budget
        # A body holds at most one object per byte: small ones need no scan.
        if budget is not None and len(body) > budget.max_containers:
            why = _over_budget(body, budget)
            if why is not None:
                raise self._end(
                    bad_request(
                        f"frame too complex to decode: {why}, more than any request "
                        f"holds (the largest declares limits.max_members members)",
                        "too_many_objects",
                    )
                )
        try:
            return unpack_strict(body, self._limits)
        except UnpackError as exc:
            raise self._end(bad_request(f"undecodable frame: {exc}", "undecodable")) from None

    def _end(self, err: ApiError) -> ApiError:
        """The stream ends with ``err``: nothing after it is read."""
        self.failed = err
        self._buf.clear()
        return err


def ok(rid: int, result: Any) -> dict[str, Any]:
    """A success reply."""
    return {"id": rid, "ok": result}


def error(rid: int | None, err: ApiError) -> dict[str, Any]:
    """An error reply (``id`` nil when the request's id was unreadable)."""
    return {"id": rid, "error": err.to_wire()}


def event(rid: int, result: Any) -> dict[str, Any]:
    """One watch event."""
    return {"id": rid, "event": result}


_EVENT_KEYS = (pack("id"), pack("event"))


def event_frame(rid: int, packed_result: bytes) -> bytes:
    """``encode_frame(event(rid, result))``, byte for byte, from ``result`` already
    packed: thousands of watchers of one stream share one encoding of its state."""
    body = b"\x82" + _EVENT_KEYS[0] + pack(rid) + _EVENT_KEYS[1] + packed_result
    return LENGTH.pack(len(body)) + body


def error_from_wire(obj: Any) -> ApiError:
    """Rebuild the `ApiError` of an error reply (clients)."""
    if not isinstance(obj, Mapping):
        return ApiError(ErrorKind.INTERNAL, "bad_reply", f"malformed error reply: {obj!r}")
    try:
        kind = ErrorKind(str(obj.get("kind")))
    except ValueError:
        kind = ErrorKind.INTERNAL
    return ApiError(kind, str(obj.get("reason", "")), str(obj.get("message", "")))
