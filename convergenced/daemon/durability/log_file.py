"""The write-ahead log file: its format, and telling a torn tail from corruption.

Every fact the daemon acts on, and every incarnation, is appended here and fsynced
before anything that reveals it leaves the process. Replaying the log rebuilds the
node after a crash (`NodeCore.replay`). This module does blocking file I/O; the
group commit (`group_commit`) runs it on its disk thread.

**Format (version 2).** An 8-byte file header, ``b"CVWL"``, the format version (2)
and three zero bytes, then *groups*. A group is what one write and one fsync put
on disk, and carries numbered entries::

    group header (28 bytes, big-endian)
      0   4  magic        b"CVWG"
      4   4  body length  bytes of the entries that follow
      8   8  first seq    sequence number of the group's first entry
      16  4  count        entries in the group
      20  4  body CRC-32
      24  4  header CRC-32, of bytes 0..23
    body: count x (u32 length | msgpack payload)

Sequence numbers start at 1 in every file and run without gaps.

**Torn tail or corruption.** A crash can cut the *last* write short, and only the
last: every earlier write returned from its fsync. So on open a damaged group (a
header or body that fails its checksum, a length past the end of the file, a
group cut short) after which no intact group follows is a torn tail: it was never
acknowledged, and it is truncated away and reported. Anything else is damage to
acknowledged facts, and opening fails with `WalCorruptError` naming the offset:
a damaged group with an intact one after it (whatever its length field claims),
or intact groups whose sequence numbers skip (a group removed from the middle).
An empty file, or one cut inside its 8-byte header, is damage too: the file is
created atomically (temporary file, fsync, rename, directory fsync), so it never
exists without its header.

Logs of format version 1 (entries each with a length and a CRC, no groups, no
sequence numbers) are read as they always were and rewritten at once, atomically,
in version 2 before anything is appended.

**Compaction** writes the surviving facts as a new file (`fsutil.write_atomic`), so
a crash leaves either the old or the new log, never a mix.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgpack

from convergenced import fsutil
from convergenced.core.packing import UnpackError, UnpackLimits, pack, unpack_strict
from convergenced.daemon.durability.entries import Entry, decode_entry, encode_entry
from convergenced.errors import ConvergencedError

MAGIC = b"CVWL"
VERSION = 2
FILE_HEADER = MAGIC + bytes([VERSION, 0, 0, 0])
GROUP_MAGIC = b"CVWG"
GROUP_HEADER = struct.Struct(">4sIQII")
"""magic, body length, first seq, count, body CRC; then the header's own CRC."""
GROUP_HEADER_SIZE = GROUP_HEADER.size + 4
ENTRY_LENGTH = struct.Struct(">I")
MAX_ENTRY_BYTES = 16 << 20
"""No single fact comes near this; a larger length field means corruption."""
_UNPACK = UnpackLimits(MAX_ENTRY_BYTES, MAX_ENTRY_BYTES, 1 << 20, 1 << 16)
_V1_HEADER = MAGIC + bytes([1, 0, 0, 0])
_V1_ENTRY = struct.Struct(">II")


class WalCorruptError(ConvergencedError):
    """The log is damaged where acknowledged facts live; the daemon must not start."""


@dataclass(frozen=True, slots=True)
class OpenReport:
    """What opening the log found."""

    entries: int
    torn_tail_bytes: int
    """Bytes of an unfinished last write that were truncated (0: clean)."""
    detail: str = ""
    """What ended the good part of the log, when something did."""
    upgraded_from: int | None = None
    """The format version the log was rewritten from at open, if it was."""


def encode_group(entries: list[bytes], first_seq: int) -> bytes:
    """One group of already-framed entries (see the module docstring)."""
    body = b"".join(entries)
    head = GROUP_HEADER.pack(GROUP_MAGIC, len(body), first_seq, len(entries), zlib.crc32(body))
    return head + struct.pack(">I", zlib.crc32(head)) + body


def frame_entry(entry: Entry) -> bytes:
    """One entry as it sits in a group body: length, then the msgpack payload."""
    payload = pack(encode_entry(entry))
    return ENTRY_LENGTH.pack(len(payload)) + payload


def encode_log(entries: list[Entry]) -> bytes:
    """A whole log file holding ``entries`` (one group, from sequence number 1)."""
    framed = [frame_entry(e) for e in entries]
    return FILE_HEADER + (encode_group(framed, 1) if framed else b"")


class FactLog:
    """An open log: `append` buffers, `take_pending` + `write_durably` make durable.

    Use `FactLog.open`.
    """

    def __init__(self, path: Path, fd: int, next_seq: int) -> None:
        self.path = path
        self._fd = fd
        self._pending: list[bytes] = []
        self._next_seq = next_seq
        self._packer = msgpack.Packer(use_bin_type=True)
        """`append`'s own (the event loop's): `pack`'s bytes, without making a packer
        per entry. Compaction, on the disk thread, packs with `pack`."""
        self.synced_bytes = os.fstat(fd).st_size
        """Size of the log on disk (what is durable)."""

    @classmethod
    def open(cls, path: Path) -> tuple[FactLog, list[Entry], OpenReport]:
        """Open (or create) the log at ``path`` and read back every entry.

        Raises:
            WalCorruptError: the log is damaged before its last write, is empty or
                cut inside its header, or is not a convergenced log.
        """
        path = Path(path)
        for stale in fsutil.temp_files(path, other_processes_only=False):
            stale.unlink()  # a compaction that crashed before its rename
        upgraded: int | None = None
        entries: list[Entry]
        if not path.exists():
            fsutil.write_atomic(path, FILE_HEADER)
            entries, good_end, detail = [], len(FILE_HEADER), ""
            size = good_end
        else:
            data = path.read_bytes()
            size = len(data)
            if data[: len(FILE_HEADER)] == _V1_HEADER:
                entries, good_end, detail = _scan_v1(path, data)
                upgraded = 1
            else:
                entries, good_end, detail = _scan(path, data)
        if upgraded is not None:
            fsutil.write_atomic(path, encode_log(entries))
        elif good_end < size:
            with open(path, "r+b") as f:
                f.truncate(good_end)
                f.flush()
                os.fsync(f.fileno())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        report = OpenReport(len(entries), size - good_end, detail, upgraded)
        return cls(path, fd, len(entries) + 1), entries, report

    @property
    def pending(self) -> int:
        """Entries appended but not yet taken for a write."""
        return len(self._pending)

    def append(self, entry: Entry) -> None:
        """Buffer ``entry``; it is durable only once a write that holds it returned."""
        payload: bytes = self._packer.pack(encode_entry(entry))  # as frame_entry
        self._pending.append(ENTRY_LENGTH.pack(len(payload)) + payload)

    def take_pending(self) -> bytes:
        """Everything appended so far, as one group for `write_durably` (b"": none).

        Splitting the write in two lets the event loop keep appending (the next
        group) while the disk thread waits for the disk.
        """
        if not self._pending:
            return b""
        group = encode_group(self._pending, self._next_seq)
        self._next_seq += len(self._pending)
        self._pending = []
        return group

    def take_pending_one_by_one(self) -> list[bytes]:
        """`take_pending`, one group per entry (a log without group commit)."""
        groups = []
        for framed in self._pending:
            groups.append(encode_group([framed], self._next_seq))
            self._next_seq += 1
        self._pending = []
        return groups

    def write_durably(self, data: bytes) -> None:
        """Write ``data`` (a group from `take_pending`) and fsync; blocking."""
        if not data:
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)
        self.synced_bytes += len(data)

    def replace_durably(self, entries: list[Entry]) -> None:
        """Atomically replace the whole log by ``entries`` (compaction); blocking.

        Entries appended meanwhile stay buffered and go to the new file, numbered
        after ``entries``.

        Raises:
            fsutil.NotReplaced: it failed before the rename (no descriptor or no space
                for the new file): this log is untouched and still in use.
            OSError: it failed after the rename: the log is not to be trusted.
        """
        new = fsutil.replace_open(self.path, encode_log(entries))
        old, self._fd = self._fd, new
        os.close(old)
        self._next_seq = len(entries) + 1
        self.synced_bytes = os.fstat(self._fd).st_size

    def close(self) -> None:
        """Close the file (pending appends are dropped)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- reading -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Group:
    end: int
    first_seq: int
    payloads: list[bytes]


def _read_group(data: bytes, pos: int) -> _Group | str:
    """The intact group at ``pos``, or what is wrong with it."""
    if pos + GROUP_HEADER_SIZE > len(data):
        return "incomplete group header"
    magic, length, first_seq, count, body_crc = GROUP_HEADER.unpack_from(data, pos)
    (header_crc,) = struct.unpack_from(">I", data, pos + GROUP_HEADER.size)
    if magic != GROUP_MAGIC:
        return "no group header"
    if zlib.crc32(data[pos : pos + GROUP_HEADER.size]) != header_crc:
        return "group header checksum mismatch"
    start = pos + GROUP_HEADER_SIZE
    end = start + length
    if end > len(data):
        return f"group of {length} bytes cut at {len(data) - start}"
    body = data[start:end]
    if zlib.crc32(body) != body_crc:
        return "group checksum mismatch"
    payloads: list[bytes] = []
    at = 0
    for _ in range(count):
        if at + ENTRY_LENGTH.size > len(body):
            return "group body shorter than its entry count"
        (n,) = ENTRY_LENGTH.unpack_from(body, at)
        at += ENTRY_LENGTH.size
        if n > MAX_ENTRY_BYTES or at + n > len(body):
            return f"entry length {n} overruns its group"
        payloads.append(body[at : at + n])
        at += n
    if at != len(body):
        return "group body longer than its entries"
    return _Group(end, first_seq, payloads)


def _next_intact_group(data: bytes, after: int) -> int | None:
    """The offset of the first intact group that starts after ``after``, if any."""
    at = data.find(GROUP_MAGIC, after + 1)
    while at >= 0:
        if isinstance(_read_group(data, at), _Group):
            return at
        at = data.find(GROUP_MAGIC, at + 1)
    return None


def _scan(path: Path, data: bytes) -> tuple[list[Entry], int, str]:
    """Entries, the offset where good data ends, and what ended it (version 2)."""
    if len(data) < len(FILE_HEADER):
        what = "empty" if not data else f"cut inside its header ({len(data)} bytes)"
        raise WalCorruptError(
            f"{path}: the write-ahead log is {what}. It is created whole, so it was "
            "damaged afterwards, and the facts this node acknowledged may be gone; "
            "move it aside (the node then starts with an empty log) or restore it"
        )
    if data[:4] != MAGIC:
        raise WalCorruptError(f"{path}: not a convergenced write-ahead log (bad header)")
    if data[4] != VERSION:
        raise WalCorruptError(
            f"{path}: write-ahead log format version {data[4]} is not known to this "
            f"version of convergenced (it reads versions 1 and {VERSION})"
        )
    if data[: len(FILE_HEADER)] != FILE_HEADER:
        raise WalCorruptError(f"{path}: damaged file header {data[:8].hex()}")
    entries: list[Entry] = []
    pos = len(FILE_HEADER)
    seq = 1
    while pos < len(data):
        group = _read_group(data, pos)
        if isinstance(group, str):
            later = _next_intact_group(data, pos)
            if later is None:
                return entries, pos, f"torn tail at offset {pos}: {group}"
            raise WalCorruptError(
                f"{path}: damaged group at offset {pos} ({group}) with an intact group "
                f"after it at offset {later}; refusing to drop acknowledged facts"
            )
        if group.first_seq != seq:
            raise WalCorruptError(
                f"{path}: the group at offset {pos} starts at entry {group.first_seq}, "
                f"expected {seq}: entries are missing; refusing to start without them"
            )
        for i, payload in enumerate(group.payloads):
            entries.append(_decode(path, payload, f"entry {seq + i} (group at offset {pos})"))
        seq += len(group.payloads)
        pos = group.end
    return entries, pos, ""


def _decode(path: Path, payload: bytes, where: str) -> Entry:
    try:
        return decode_entry(unpack_strict(payload, _UNPACK))
    except (UnpackError, ValueError) as exc:  # checksum was right: a newer version?
        raise WalCorruptError(f"{path}: {where} unreadable: {exc}") from None


def _scan_v1(path: Path, data: bytes) -> tuple[list[Entry], int, str]:
    """Format version 1: ``u32 length | u32 CRC | payload`` entries, no groups."""
    entries: list[Entry] = []
    pos = len(_V1_HEADER)
    while pos < len(data):
        if pos + _V1_ENTRY.size > len(data):
            return entries, pos, f"torn tail at offset {pos}: incomplete entry header"
        length, crc = _V1_ENTRY.unpack_from(data, pos)
        if length > MAX_ENTRY_BYTES:
            raise WalCorruptError(f"{path}: entry at offset {pos} claims {length} bytes: corrupt")
        end = pos + _V1_ENTRY.size + length
        if end > len(data) or zlib.crc32(data[pos + _V1_ENTRY.size : end]) != crc:
            if end >= len(data):
                return entries, pos, f"torn tail at offset {pos}"
            raise WalCorruptError(
                f"{path}: corrupt entry at offset {pos} with {len(data) - end} more bytes "
                "after it; refusing to drop acknowledged facts"
            )
        entries.append(_decode(path, data[pos + _V1_ENTRY.size : end], f"entry at offset {pos}"))
        pos = end
    return entries, pos, ""
