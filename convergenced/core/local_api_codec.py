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
from enum import StrEnum
from typing import Any, NamedTuple

import msgpack

from convergenced.core.errors import RemoteProtocolError, SpecError
from convergenced.core.facts import Commit, ComponentReport, Declare, Retire, Retract, Undeclare
from convergenced.core.limits import MAX_DIGEST_CHARS, MAX_RANKS_PER_MEMBER
from convergenced.core.packing import UnpackError, UnpackLimits, pack, unpack_strict
from convergenced.core.spec import StreamSpec
from convergenced.core.validate import (
    INT64_MAX,
    as_bool,
    as_int,
    as_list,
    as_map,
    as_name,
    as_str,
)
from convergenced.core.versions import MAX_COMPONENTS, MAX_VERSION_CHARS, MAX_VERSIONS
from convergenced.errors import ConvergencedError

LENGTH = struct.Struct(">I")
DEFAULT_MAX_FRAME = 1 << 20
MAX_TIMEOUT_S = 7 * 24 * 3600.0


class ErrorKind(StrEnum):
    """Whose move it is after an error."""

    BAD_REQUEST = "bad_request"
    """The request is malformed: fix the caller."""
    REJECTED = "rejected"
    """Well-formed but refused by the rules (unknown stream, spec conflict, retired
    epoch...). Nothing changed."""
    TIMEOUT = "timeout"
    """A wait ran out of time; nothing changed, ask again."""
    UNAVAILABLE = "unavailable"
    """The daemon cannot serve this now (shutting down, too many clients, too slow)."""
    INTERNAL = "internal"
    """A bug in the daemon; the message says what failed."""


class ApiError(ConvergencedError):
    """An error reply: raised by the daemon's handlers, re-raised by the clients."""

    def __init__(self, kind: ErrorKind, reason: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.reason = reason
        self.request_id: int | None = None
        """The id of the request that failed, when it could be read."""

    def to_wire(self) -> dict[str, str]:
        """The ``error`` map of a reply."""
        return {"kind": self.kind.value, "reason": self.reason, "message": str(self)}


def bad_request(message: str, reason: str = "bad_request") -> ApiError:
    """An `ApiError` for a malformed request."""
    return ApiError(ErrorKind.BAD_REQUEST, reason, message)


# -- framing --------------------------------------------------------------------


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


# -- requests -------------------------------------------------------------------


class Request(NamedTuple):
    """A validated request. ``args`` holds typed values (facts, names, numbers).

    A named tuple rather than a frozen dataclass: as immutable, and made in a third
    of the time (one per request)."""

    id: int
    op: str
    args: Mapping[str, Any]


_NAMES: set[str] = set()
"""Names `_name` found valid lately: the same few stream and domain names come in
every commit, and a set lookup is cheaper than the pattern."""
_MAX_NAMES = 4096


def _name(value: Any, path: str) -> str:
    """`as_name`, remembering the valid names (a bounded number of them)."""
    if type(value) is str and value in _NAMES:
        return value
    name = as_name(value, path)
    if len(_NAMES) >= _MAX_NAMES:
        _NAMES.clear()  # a client inventing names only ever costs the pattern again
    _NAMES.add(name)
    return name


def _int(value: Any, path: str) -> int:
    """`as_int` with the bounds of a rank, an epoch or a size."""
    if type(value) is int and 0 <= value <= INT64_MAX:
        return value
    return as_int(value, path)


def _stream(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"stream": _name(a.get("stream"), f"{p}.stream")}


def _epoch_fact(cls: type[Commit] | type[Retract] | type[Retire]) -> Any:
    # The paths of the fields are made only for an error: a commit is parsed tens of
    # thousands of times a second.
    def parse(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
        stream = _name(a.get("stream"), p + ".stream")
        rank = _int(a.get("rank"), p + ".rank")
        domain = _name(a.get("domain"), p + ".domain")
        epoch = _int(a.get("epoch"), p + ".epoch")
        if cls is Commit:
            digest = a.get("digest", "")
            if type(digest) is not str or len(digest) > MAX_DIGEST_CHARS:
                as_str(digest, p + ".digest", max_len=MAX_DIGEST_CHARS)  # raises
            size = _int(a.get("size", 0), p + ".size")
            return {"fact": Commit(stream, rank, domain, epoch, digest, size)}
        return {"fact": cls(stream, rank, domain, epoch)}

    return parse


def _timeout(a: Mapping[Any, Any], p: str) -> float | None:
    t = a.get("timeout")
    if t is None:
        return None
    if type(t) not in (int, float) or not 0 <= t <= MAX_TIMEOUT_S:  # NaN fails the range
        raise bad_request(f"{p}.timeout: {t!r}; expected seconds from 0 to {MAX_TIMEOUT_S:.0f}")
    return float(t)


def _declare(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    allow = as_bool(a.get("allow_unknown_members", False), f"{p}.allow_unknown_members")
    try:
        fact = Declare(StreamSpec.from_wire(a.get("spec")))
    except SpecError as exc:
        raise bad_request(f"{p}.{exc}", "bad_spec") from None
    return {"fact": fact, "allow_unknown_members": allow}


def _undeclare(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"fact": Undeclare(as_name(a.get("stream"), f"{p}.stream"))}


def _wait(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["epoch"] = as_int(a.get("epoch"), f"{p}.epoch")
    out["timeout"] = _timeout(a, p)
    return out


def _restore_point(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["generation"] = as_int(a.get("generation"), f"{p}.generation")
    out["timeout"] = _timeout(a, p)
    return out


def _next_generation(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    out = _stream(a, p)
    out["timeout"] = _timeout(a, p)
    return out


MAX_DRAIN_STREAMS = 256
"""Streams one drain request may name."""


def _version(v: Any, path: str) -> str:
    return as_str(v, path, max_len=MAX_VERSION_CHARS)


def _report_version(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    running = _version(a.get("running"), f"{p}.running")
    accepts = as_list(a.get("accepts", [running]), f"{p}.accepts", max_len=MAX_VERSIONS)
    vs = tuple(_version(v, f"{p}.accepts[{i}]") for i, v in enumerate(accepts))
    return {"fact": ComponentReport(as_name(a.get("component"), f"{p}.component"), running, vs)}


def _versions(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    stream = a.get("stream")
    return {"stream": None if stream is None else _name(stream, f"{p}.stream")}


def _drain(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    names = as_list(a.get("streams", []), f"{p}.streams", max_len=MAX_DRAIN_STREAMS)
    moves = as_map(a.get("versions", {}), f"{p}.versions", max_len=MAX_COMPONENTS)
    return {
        "versions": {
            as_name(c, f"{p}.versions"): _version(v, f"{p}.versions.{c}") for c, v in moves.items()
        },
        "node": as_name(a.get("node"), f"{p}.node"),
        "streams": tuple(sorted({_name(n, f"{p}.streams[{i}]") for i, n in enumerate(names)})),
        "checkpoint": as_bool(a.get("checkpoint", False), f"{p}.checkpoint"),
        "timeout": _timeout(a, p),
    }


def _cancel(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {"target": as_int(a.get("target"), f"{p}.target")}


def _none(a: Mapping[Any, Any], p: str) -> dict[str, Any]:
    return {}


_OPS: dict[str, tuple[Any, frozenset[str]]] = {
    # op: (parser, allowed argument names)
    "status": (_none, frozenset()),
    "streams": (_none, frozenset()),
    "declare": (_declare, frozenset(("spec", "allow_unknown_members"))),
    "undeclare": (_undeclare, frozenset(("stream",))),
    "commit": (
        _epoch_fact(Commit),
        frozenset(("stream", "rank", "domain", "epoch", "digest", "size")),
    ),
    "retract": (_epoch_fact(Retract), frozenset(("stream", "rank", "domain", "epoch"))),
    "retire": (_epoch_fact(Retire), frozenset(("stream", "rank", "domain", "epoch"))),
    "state": (_stream, frozenset(("stream",))),
    "wait": (_wait, frozenset(("stream", "epoch", "timeout"))),
    "restore_point": (_restore_point, frozenset(("stream", "generation", "timeout"))),
    "next_generation": (_next_generation, frozenset(("stream", "timeout"))),
    "watch": (_stream, frozenset(("stream",))),
    "drain": (_drain, frozenset(("node", "streams", "checkpoint", "timeout", "versions"))),
    "report_version": (_report_version, frozenset(("component", "running", "accepts"))),
    "versions": (_versions, frozenset(("stream",))),
    "cancel": (_cancel, frozenset(("target",))),
}
OPS = tuple(_OPS)
"""Every operation the local API knows."""
_REQUEST_FIELDS = frozenset(("id", "op", "args"))


def parse_request(obj: Any) -> Request:
    """Validate a decoded request map.

    Raises:
        ApiError: ``bad_request``, naming the field (``commit.epoch: -1 is negative``).
            When the id itself was readable, it is in ``ApiError.request_id``.
    """
    # Each check has a fast test for what a well-formed request holds (decoded maps
    # are dicts), and falls back to the checker that names what is wrong.
    try:
        m = obj if type(obj) is dict and len(obj) <= 3 else as_map(obj, "request", max_len=3)
        rid = _int(m.get("id"), "request.id")
    except RemoteProtocolError as exc:
        raise bad_request(str(exc)) from None
    try:
        if not _REQUEST_FIELDS.issuperset(m):
            unknown = sorted(str(k) for k in m if k not in _REQUEST_FIELDS)
            raise bad_request(f"request: unknown field {unknown[0]!r}")
        op: Any = m.get("op")  # checked next: an op of the table is a short str
        entry = _OPS.get(op) if type(op) is str else None
        if entry is None:
            op = as_str(m.get("op"), "request.op", max_len=64)
            raise bad_request(
                f"request.op: {op!r} is not an operation; expected one of {', '.join(OPS)}",
                "unknown_op",
            )
        parser, allowed = entry
        args = m.get("args", {})
        if type(args) is not dict or len(args) > 16:
            args = as_map(args, f"{op}.args", max_len=16)
        if not allowed.issuperset(args):
            extra = sorted(str(k) for k in args if k not in allowed)
            raise bad_request(f"{op}.args: unknown argument {extra[0]!r}")
        return Request(rid, op, parser(args, op))
    except RemoteProtocolError as exc:
        err = bad_request(str(exc))
        err.request_id = rid
        raise err from None
    except ApiError as err:
        err.request_id = rid
        raise


def request(rid: int, op: str, **args: Any) -> dict[str, Any]:
    """Build a request map (clients); ``None`` arguments are left out."""
    if op not in _OPS:
        raise ValueError(f"unknown operation {op!r}")
    return {"id": rid, "op": op, "args": {k: v for k, v in args.items() if v is not None}}


# -- replies ----------------------------------------------------------------------


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
