"""Durable file operations: atomic replacement and directory fsync.

One place for the sequence every durable file of convergenced follows (the
write-ahead log's compaction, identity and CA keys, checkpoint shards): write a
temporary file in the same directory, fsync it, give it its final name with one
``rename`` (or ``link``, which refuses an existing name), then fsync the directory
so the name itself survives a crash. A reader, or a restart after a crash, sees the
old file or the new one, whole, never a mix.

Temporary files are named ``.<name>.<pid>.<random>.tmp``: a crash between the write
and the rename leaves one behind, and whoever owns the directory can recognise and
sweep it (`temp_files`) without touching another live process's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def fsync_file(path: Path | str) -> None:
    """fsync the data of the file at ``path`` (a read-only descriptor is enough on
    Linux), for files another writer wrote and closed without it."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path | str) -> None:
    """fsync ``directory``, so that names created or removed in it survive a crash."""
    fd = os.open(directory, os.O_RDONLY | _O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each one durably.

    Every directory this call creates is fsynced into its parent: without that, a
    crash can forget a new directory and every file written into it.
    """
    missing: list[Path] = []
    d = directory
    while not d.is_dir():
        missing.append(d)
        if d.parent == d:
            break
        d = d.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        fsync_dir(d.parent)


def temp_path(path: Path) -> Path:
    """A fresh temporary name next to ``path`` (see the module docstring)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")


def temp_files(path: Path, *, other_processes_only: bool = True) -> list[Path]:
    """Temporary files of `write_atomic` for ``path`` left in its directory.

    With ``other_processes_only`` the current process's own are left out: it may be
    writing one right now.
    """
    ours = f".{path.name}.{os.getpid()}."
    found = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    return [p for p in found if not (other_processes_only and p.name.startswith(ours))]


def write_atomic(
    path: Path | str,
    data: bytes,
    *,
    overwrite: bool = True,
    chmod: int | None = None,
    make_parents: bool = False,
) -> None:
    """Put ``data`` at ``path`` so that a crash leaves the old state or all of the new.

    Args:
        path: the final name.
        data: the whole content.
        overwrite: replace an existing file (``rename``); False refuses to (``link``,
            so two writers racing for a new name cannot both win).
        chmod: the file's exact mode, whatever the umask (for private keys); None
            creates it 0644 minus the umask.
        make_parents: create missing parent directories first, durably.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
        OSError: the directory is missing or not writable, the disk is full...
    """
    path = Path(path)
    tmp = temp_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
    for attempt in range(3):
        if make_parents:
            makedirs_durable(path.parent)
        try:
            fd = os.open(tmp, flags, 0o644 if chmod is None else chmod)
            break
        except FileNotFoundError:
            # The directory vanished between the two calls (a concurrent cleanup
            # removed it while empty): create it again, a few times at most.
            if not make_parents or attempt == 2:
                raise
    try:
        try:
            if chmod is not None:
                os.fchmod(fd, chmod)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)


class NotReplaced(OSError):
    """`replace_open` failed before its rename: the old file is untouched, in place."""


def replace_open(path: Path | str, data: bytes) -> int:
    """Replace ``path`` by ``data`` atomically and return the new file, opened for
    appending (a log that goes on after a compaction).

    Unlike `write_atomic`, every descriptor it needs (the directory's, the new
    file's) is opened before the rename, so running out of descriptors (EMFILE) or of
    space fails with `NotReplaced`, and the old file stays in place and usable. Only
    the fsync of the directory comes after the rename.

    Raises:
        NotReplaced: nothing changed (the OSError's errno and message are kept).
        OSError: the directory's fsync after the rename failed: the name may point
            to either file after a crash.
    """
    path = Path(path)
    tmp = temp_path(path)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as exc:
        raise NotReplaced(exc.errno, f"{path.parent}: {exc.strerror}") from exc
    try:
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _O_CLOEXEC
            fd = os.open(tmp, flags, 0o644)
        except OSError as exc:
            raise NotReplaced(exc.errno, f"{tmp}: {exc.strerror}") from exc
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.replace(tmp, path)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise NotReplaced(exc.errno, f"{tmp}: {exc.strerror}") from exc
        try:
            os.fsync(dir_fd)
        except OSError:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(dir_fd)


def _link_new(tmp: Path, path: Path) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        # Some file systems have no hard links: fall back to check, then rename.
        if path.exists():
            raise FileExistsError(f"{path} exists") from None
        os.replace(tmp, path)
