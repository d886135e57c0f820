"""Is a file finished? Stability over a settle period, format checks, digests.

A framework that writes its checkpoint files with plain ``open``/``torch.save`` gives
no sign that a file is finished: its name appears with the first byte. The marker
counts a file only when all of these hold:

1. it exists, is a regular file and is not empty;
2. its signature (size, mtime in nanoseconds, inode, device) has not changed over
   at least the settle period: it was seen with the same signature by two looks at
   least ``settle`` seconds apart (by `time.monotonic`, never the wall clock);
3. where the format says how a complete file ends, it ends so: a ``.pt`` file must
   be a zip archive whose central directory, written last by ``torch.save``, is
   there and parses (`zip_complete`), and a DCP step's files must hold every byte
   its metadata references;
4. after it is fsynced by the marker (its data and its directory: a file the writer
   never fsynced is on disk once the marker commits it) and read for its digest, its
   signature is still the same.

What the marker cannot know: whether a writer that is still alive will open the file
again and write more after a pause longer than the settle period (torch.save does
not; a framework that re-saves a step in place does, and the marker then retracts
the step when it sees the signature change), and whether the bytes are the ones the
framework meant (a complete zip of the wrong tensors is complete). The digest is of
the bytes on disk when committed, so a later change is detected.

**Cost.** A digest reads every byte of the file once (sha256, 1 MiB reads), cached by
signature, so a file several ranks need (a Megatron model-parallel group's file, a
DCP step's files) is read once, and a committed step is never read again unless it
changes; checking a committed step again costs one ``stat`` per file.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DigestCache", "Settler", "Signature", "signature", "zip_complete"]

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Signature:
    """What changes when a file is written to: size, mtime (ns), inode, device."""

    size: int
    mtime_ns: int
    ino: int
    dev: int


def signature(path: Path) -> Signature | None:
    """The file's signature, or None when it is missing or not a regular file."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return Signature(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


class Settler:
    """Remembers since when each file has had its current signature."""

    def __init__(self, settle: float, clock: Callable[[], float]) -> None:
        if settle < 0:
            raise ValueError(f"settle {settle!r} is negative")
        self.settle = settle
        self._clock = clock
        self._since: dict[Path, tuple[Signature, float]] = {}

    def look(self, path: Path) -> tuple[Signature | None, bool]:
        """Look at ``path`` now: (its signature, whether it has held it for ``settle``).

        A file's first look never counts as settled unless ``settle`` is 0.
        """
        sig = signature(path)
        now = self._clock()
        if sig is None:
            self._since.pop(path, None)
            return None, False
        seen = self._since.get(path)
        if seen is None or seen[0] != sig:
            self._since[path] = (sig, now)
            return sig, self.settle == 0
        return sig, now - seen[1] >= self.settle

    def forget(self, paths: Iterable[Path]) -> None:
        """Drop what is remembered of ``paths`` (a step deleted or committed)."""
        for p in paths:
            self._since.pop(p, None)


def zip_complete(path: Path) -> str | None:
    """None when ``path`` is a complete zip archive (torch.save's format), else why not.

    Opening it reads the end-of-central-directory record, which ``torch.save`` writes
    last, and the central directory it points to: a file cut short lacks them.
    """
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except zipfile.BadZipFile as exc:
        return f"not a complete torch.save (zip) file: {exc}"
    except OSError as exc:
        return f"unreadable: {exc}"
    if not infos:
        return "an empty zip archive"
    return None


class DigestCache:
    """sha256 of files, computed once per signature."""

    def __init__(self) -> None:
        self._known: dict[tuple[Path, Signature], str] = {}
        self.bytes_read = 0
        """Bytes read for digests so far (each file once per signature)."""

    def sha256(self, path: Path, sig: Signature) -> str | None:
        """The hex sha256 of ``path``, or None when it changed while being read."""
        key = (path, sig)
        if key in self._known:
            return self._known[key]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                self.bytes_read += len(chunk)
        if signature(path) != sig:
            return None
        self._known[key] = h.hexdigest()
        return self._known[key]

    def forget(self, paths: Iterable[Path]) -> None:
        """Drop the digests of ``paths``."""
        drop = set(paths)
        for key in [k for k in self._known if k[0] in drop]:
            del self._known[key]
