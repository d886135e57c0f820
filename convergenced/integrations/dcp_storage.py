"""The storage under a DCP checkpoint root: a local directory or an fsspec URL.

The DCP modules need few operations: list a directory's files with their sizes (or
its subdirectories), read or stream a file, make names durable, delete a file and an
empty directory. `DcpStorage` does them on a local path (``file://`` URLs included)
with plain ``os`` calls, and through fsspec for any other ``scheme://`` URL.

**Durability.** Locally, `DcpStorage.make_durable` fsyncs each file, then the
directory and its parent (the step directory DCP just created is itself a new name in
the root). An object store has no fsync: fsspec's ``close`` of a written object
returns once the store accepted it (a completed PUT or multipart upload), which is as
durable as the store makes anything, so there is nothing more to do.

**The digest of a rank's files** (`files_digest`): SHA-256 over the files in name
order, each framed as its name, a NUL byte, its size as 8 big-endian bytes and its
bytes, so two different sets of files never hash alike. Computing it reads the files
once, in 1 MiB chunks (from the page cache right after a local write; one GET of each
on an object store).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from convergenced import fsutil

__all__ = ["DcpStorage", "files_digest", "files_location", "join"]

_CHUNK = 1 << 20


def join(location: str | os.PathLike[str], name: str) -> str:
    """``name`` inside the directory ``location`` (a path or a URL)."""
    base = os.fspath(location)
    return f"{base.rstrip('/')}/{name}" if "://" in base else os.path.join(base, name)


class DcpStorage:
    """One directory of a checkpoint root (see the module docstring)."""

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.where = os.fspath(location)
        """The location as given."""
        self.local: str | None = self.where
        """The local path, or None when the location goes through fsspec."""
        self._fs: Any = None
        self._root = self.where
        if "://" in self.where:
            from fsspec.core import url_to_fs  # type: ignore[import-untyped]  # URLs only
            from fsspec.implementations.local import (  # type: ignore[import-untyped]
                LocalFileSystem,
            )

            fs, root = url_to_fs(self.where)
            if isinstance(fs, LocalFileSystem):
                self.local = str(root)
            else:
                self._fs, self._root, self.local = fs, str(root).rstrip("/"), None

    def _path(self, name: str) -> str:
        if self.local is not None:
            return os.path.join(self.local, name)
        return f"{self._root}/{name}"

    def _entries(self) -> list[tuple[str, str, int]] | None:
        """(name, "file" | "directory", size) of every entry; None: no such directory."""
        if self.local is not None:
            try:
                with os.scandir(self.local) as it:
                    entries = list(it)
            except (FileNotFoundError, NotADirectoryError):
                return None
            out: list[tuple[str, str, int]] = []
            for e in entries:
                try:
                    if e.is_dir():
                        out.append((e.name, "directory", 0))
                    elif e.is_file():
                        out.append((e.name, "file", e.stat().st_size))
                except FileNotFoundError:
                    continue  # removed while we listed
            return out
        try:
            self._fs.invalidate_cache(self._root)
            infos = self._fs.ls(self._root, detail=True)
        except FileNotFoundError:
            return None
        return [
            (
                str(i["name"]).rstrip("/").rsplit("/", 1)[-1],
                "directory" if i.get("type") == "directory" else "file",
                int(i.get("size") or 0),
            )
            for i in infos
        ]

    def files(self) -> dict[str, int] | None:
        """Every file's name -> size; None when the directory does not exist."""
        entries = self._entries()
        if entries is None:
            return None
        return {name: size for name, kind, size in entries if kind == "file"}

    def subdirs(self) -> list[str]:
        """The names of the subdirectories (none when the directory does not exist)."""
        return sorted(name for name, kind, _ in self._entries() or () if kind == "directory")

    def child(self, name: str) -> DcpStorage:
        """The subdirectory ``name``."""
        return DcpStorage(join(self.where, name))

    def open(self, name: str) -> IO[bytes]:
        """``name``, open for reading."""
        if self.local is not None:
            return open(self._path(name), "rb")
        f: IO[bytes] = self._fs.open(self._path(name), "rb")
        return f

    def read(self, name: str) -> bytes:
        """The bytes of ``name``."""
        with self.open(name) as f:
            return f.read()

    def make_durable(self, names: Iterable[str]) -> None:
        """Make the files ``names`` and their names durable (see the module docstring)."""
        if self.local is None:
            return
        for name in names:
            fsutil.fsync_file(self._path(name))
        fsutil.fsync_dir(self.local)
        fsutil.fsync_dir(os.path.dirname(os.path.abspath(self.local)))

    def remove(self, name: str) -> bool:
        """Delete the file ``name``; False when it was not there."""
        try:
            if self.local is not None:
                os.unlink(self._path(name))
            else:
                self._fs.rm_file(self._path(name))
        except FileNotFoundError:
            return False
        return True

    def remove_dir_if_empty(self) -> bool:
        """Remove this directory if nothing is left in it; True when it is gone."""
        if self.local is not None:
            try:
                os.rmdir(self.local)
            except FileNotFoundError:
                return True
            except OSError:
                return False
            with contextlib.suppress(OSError):
                fsutil.fsync_dir(os.path.dirname(os.path.abspath(self.local)))
            return True
        # An object store has no directories: the prefix is gone with its last object.
        with contextlib.suppress(FileNotFoundError, OSError):
            if not self._fs.ls(self._root):
                self._fs.rmdir(self._root)
        return not self.files()


def files_location(storage: DcpStorage, names: Iterable[str]) -> dict[str, Any]:
    """The ``location`` a commit of ``names`` in ``storage`` states, so the daemon can
    verify them later by the recipe of `files_digest` (`convergenced.core.locations`)."""
    where = os.fspath(storage.where)
    url = where if "://" in where else Path(where).absolute().as_uri()
    return {"kind": "files", "url": url, "names": sorted(names)}


def files_digest(storage: DcpStorage, names: Iterable[str]) -> tuple[str, int]:
    """``("sha256:<hex>", total bytes)`` of the files ``names`` (see the module docstring).

    Raises:
        FileNotFoundError: a file is missing.
    """
    h = hashlib.sha256()
    total = 0
    for name in sorted(names):
        with storage.open(name) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            h.update(name.encode() + b"\0" + size.to_bytes(8, "big"))
            read = 0
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                read += len(chunk)
        if read != size:
            raise OSError(f"{join(storage.where, name)}: changed while it was read")
        total += size
    return f"sha256:{h.hexdigest()}", total
