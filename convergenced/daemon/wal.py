"""The write-ahead log of local facts.

Every fact the daemon acts on (declarations, commits, retractions, retirements,
frozen sets, high-water marks, generation closures) and every incarnation is
appended here and fsynced before it is acknowledged or published. Replaying the log
rebuilds the node after a crash (`NodeCore.replay`).

On disk: an 8-byte file header (``b"CVWL"``, format version 1, three zero bytes),
then entries::

    u32 length (big-endian) | u32 CRC-32 of the payload | payload (msgpack array)

**Group commit.** `append` only buffers; `sync` writes everything buffered in one
``write`` and one ``fsync``, so every fact appended before a `sync` becomes durable
together. The caller acknowledges facts only after the `sync` that covers them.

**Torn and corrupt tails.** A crash can cut the last entry short. On open, an entry
that is incomplete, or whose checksum fails, *and that reaches the end of the file* is
a torn tail: it is reported and truncated away (it was never acknowledged, because its
fsync never returned). A bad entry followed by more data is not a torn write but
corruption of acknowledged facts: opening fails with `WalCorruptError` instead of
silently dropping them.

**Compaction** writes the surviving facts to a temporary file, fsyncs it, renames it
over the log and fsyncs the directory, so a crash leaves either the old or the new
log, never a mix.

This module does blocking file I/O; the trio adapter runs it in a worker thread.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from convergenced.core.facts import (
    CloseGenerations,
    Commit,
    Declare,
    Fact,
    Freeze,
    HighWater,
    RankState,
    Retire,
    Retract,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.spec import StreamSpec
from convergenced.errors import ConvergencedError

FILE_HEADER = b"CVWL\x01\x00\x00\x00"
ENTRY_HEADER = struct.Struct(">II")
MAX_ENTRY_BYTES = 16 << 20
"""No single fact comes near this; a larger length field means corruption."""


class WalCorruptError(ConvergencedError):
    """The log holds a damaged entry before its end: acknowledged facts are at risk."""


@dataclass(frozen=True, slots=True)
class Incarnation:
    """The daemon started for the ``number``-th time (persisted before serving)."""

    number: int


Entry = Fact | Incarnation


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What opening the log found."""

    entries: int
    torn_tail_bytes: int
    """Bytes of an unfinished last entry that were truncated (0: clean)."""
    detail: str = ""


# -- entry codec ----------------------------------------------------------------


def encode_entry(entry: Entry) -> list[Any]:
    """The msgpack-ready payload of one entry."""
    if isinstance(entry, Incarnation):
        return ["incarnation", entry.number]
    if isinstance(entry, Declare):
        return ["declare", entry.spec.to_wire()]
    if isinstance(entry, Commit):
        return [
            "commit",
            entry.stream,
            entry.rank,
            entry.domain,
            entry.epoch,
            entry.digest,
            entry.size,
        ]
    if isinstance(entry, Retract):
        return ["retract", entry.stream, entry.rank, entry.domain, entry.epoch]
    if isinstance(entry, Retire):
        return ["retire", entry.stream, entry.rank, entry.domain, entry.epoch]
    if isinstance(entry, Freeze):
        return ["freeze", entry.stream, entry.generation, entry.epochs.encode()]
    if isinstance(entry, HighWater):
        return ["high_water", entry.stream, entry.epoch, [list(e) for e in entry.evidence]]
    if isinstance(entry, RankState):
        return [
            "rank_state",
            entry.stream,
            entry.rank,
            entry.domain,
            entry.available.encode(),
            entry.retired.encode(),
        ]
    return ["close", entry.stream, entry.below]


def decode_entry(obj: Any) -> Entry:
    """Inverse of `encode_entry`.

    Raises:
        ValueError: an entry this version does not know or cannot parse.
    """
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise ValueError("entry is not a tagged array")
    kind, args = obj[0], obj[1:]
    try:
        if kind == "incarnation":
            (number,) = args
            return Incarnation(int(number))
        if kind == "declare":
            (spec,) = args
            return Declare(StreamSpec.from_wire(spec))
        if kind == "commit":
            stream, rank, domain, epoch, digest, size = args
            return Commit(stream, rank, domain, epoch, digest, size)
        if kind == "retract":
            return Retract(*args)
        if kind == "retire":
            return Retire(*args)
        if kind == "freeze":
            stream, generation, flat = args
            return Freeze(stream, generation, IntervalSet.decode(flat))
        if kind == "high_water":
            stream, epoch, evidence = args
            return HighWater(stream, epoch, tuple((m, i, v) for m, i, v in evidence))
        if kind == "rank_state":
            stream, rank, domain, available, retired = args
            return RankState(
                stream, rank, domain, IntervalSet.decode(available), IntervalSet.decode(retired)
            )
        if kind == "close":
            stream, below = args
            return CloseGenerations(stream, below)
    except (TypeError, ValueError, ConvergencedError) as exc:
        raise ValueError(f"{kind} entry: {exc}") from None
    raise ValueError(f"unknown entry kind {kind!r}")


def encode_entries(entries: list[Entry]) -> bytes:
    """The on-disk form of ``entries`` (without the file header)."""
    return b"".join(_frame(e) for e in entries)


def _frame(entry: Entry) -> bytes:
    payload = bytes(msgpack.packb(encode_entry(entry), use_bin_type=True))
    return ENTRY_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


# -- the log ----------------------------------------------------------------------


class WriteAheadLog:
    """An open log: `append` buffers, `sync` makes durable. Use `WriteAheadLog.open`."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._pending = bytearray()
        self.synced_bytes = os.fstat(fd).st_size
        """Size of the log on disk (what is durable)."""
        self.syncs = 0
        self.compactions = 0

    @classmethod
    def open(cls, path: Path) -> tuple[WriteAheadLog, list[Entry], ReplayReport]:
        """Open (or create) the log at ``path`` and read back every entry.

        Raises:
            WalCorruptError: a damaged entry before the end, or a bad file header.
        """
        path = Path(path)
        entries: list[Entry] = []
        torn = 0
        detail = ""
        if path.exists():
            data = path.read_bytes()
            entries, good_end, detail = _scan(path, data)
            torn = len(data) - good_end
            if torn:
                with open(path, "r+b") as f:
                    f.truncate(good_end)
                    f.flush()
                    os.fsync(f.fileno())
        else:
            _write_new(path, b"")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        return cls(path, fd), entries, ReplayReport(len(entries), torn, detail)

    @property
    def pending(self) -> int:
        """Bytes appended but not yet synced."""
        return len(self._pending)

    def append(self, entry: Entry) -> None:
        """Buffer ``entry``; it is durable only after the next `sync`."""
        self._pending += _frame(entry)

    def sync(self) -> None:
        """Write and fsync everything appended so far (one group commit)."""
        self.write_durably(self.take_pending())

    def take_pending(self) -> bytes:
        """Detach the appended bytes, for `write_durably` in another thread.

        Splitting `sync` in two lets the event loop keep appending (the next group)
        while a worker thread waits for the disk.
        """
        data = bytes(self._pending)
        self._pending.clear()
        return data

    def take_pending_entries(self) -> list[bytes]:
        """`take_pending`, cut into one bytes object per appended entry (each frame
        header gives its payload's length)."""
        data = self.take_pending()
        out, at = [], 0
        while at < len(data):
            end = at + ENTRY_HEADER.size + ENTRY_HEADER.unpack_from(data, at)[0]
            out.append(data[at:end])
            at = end
        return out

    def write_durably(self, data: bytes) -> None:
        """Write ``data`` (from `take_pending`) and fsync; blocking."""
        if not data:
            return
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self.synced_bytes += len(data)
        self.syncs += 1

    def compact(self, entries: list[Entry]) -> None:
        """Replace the log by ``entries`` atomically (pending appends are dropped:
        sync first)."""
        self._pending.clear()
        self.replace_durably(encode_entries(entries))

    def replace_durably(self, body: bytes) -> None:
        """Atomically replace the log's entries by ``body`` (from `encode_entries`);
        blocking. Appends buffered meanwhile stay buffered, for the new file."""
        _write_new(self.path, body)
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        os.close(old)
        self.synced_bytes = os.fstat(self._fd).st_size
        self.compactions += 1

    def close(self) -> None:
        """Close the file (pending appends are dropped: sync first)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_new(path: Path, body: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(FILE_HEADER + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _scan(path: Path, data: bytes) -> tuple[list[Entry], int, str]:
    """Entries, the offset where good data ends, and what ended it."""
    if len(data) < len(FILE_HEADER):
        # A crash while creating the file: nothing was ever acknowledged from it.
        if FILE_HEADER.startswith(data):
            return [], 0, "" if not data else "incomplete file header"
        raise WalCorruptError(f"{path}: not a convergenced write-ahead log")
    if data[: len(FILE_HEADER)] != FILE_HEADER:
        raise WalCorruptError(f"{path}: not a convergenced write-ahead log (bad header)")
    entries: list[Entry] = []
    pos = len(FILE_HEADER)
    while pos < len(data):
        bad = _bad_entry(path, data, pos)
        if bad is not None:
            problem, end = bad
            if end >= len(data):
                return entries, pos, f"torn tail at offset {pos}: {problem}"
            raise WalCorruptError(
                f"{path}: corrupt entry at offset {pos} ({problem}) with "
                f"{len(data) - end} more bytes after it; refusing to drop acknowledged facts"
            )
        length, _ = ENTRY_HEADER.unpack_from(data, pos)
        payload = data[pos + ENTRY_HEADER.size : pos + ENTRY_HEADER.size + length]
        try:
            entries.append(decode_entry(msgpack.unpackb(payload, raw=False)))
        except Exception as exc:  # checksum was right: written by a newer version?
            raise WalCorruptError(f"{path}: entry at offset {pos} unreadable: {exc}") from None
        pos += ENTRY_HEADER.size + length
    return entries, pos, ""


def _bad_entry(path: Path, data: bytes, pos: int) -> tuple[str, int] | None:
    """None if the entry at ``pos`` is whole and its checksum holds; else (problem,
    offset where the damaged entry claims to end)."""
    if pos + ENTRY_HEADER.size > len(data):
        return "incomplete entry header", len(data)
    length, crc = ENTRY_HEADER.unpack_from(data, pos)
    end = pos + ENTRY_HEADER.size + length
    if length > MAX_ENTRY_BYTES:
        # A torn write leaves a prefix of real bytes, so a whole length field is the
        # true length: an implausible one is damage, never a tail to cut quietly.
        raise WalCorruptError(f"{path}: entry at offset {pos} claims {length} bytes: corrupt")
    if end > len(data):
        return f"entry of {length} bytes cut at {len(data) - pos - ENTRY_HEADER.size}", end
    if zlib.crc32(data[pos + ENTRY_HEADER.size : end]) != crc:
        return "checksum mismatch", end
    return None
