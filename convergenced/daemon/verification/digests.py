"""Reading a committed epoch's bytes again and computing its digest (blocking: run in
a worker thread).

`measure` follows a `Location` (`convergenced.core.locations`) with the recipe of its
kind, the same the integrations computed when they committed, and returns the digest
and size it finds. Every read goes through a `Throttle`, the verifier's bandwidth cap.

Reads: ``file://`` URLs with the standard library; any other scheme through fsspec
(``s3://`` with the ``s3`` extra's s3fs, configured from the daemon's environment as
the AWS SDKs are). The outcome separates what is *evidence against the bytes*
(`Missing`, and a digest or size that differs) from what is not (`Unreadable`: no
reader for the scheme, a permission or network error): only evidence makes the
verifier retract.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Final
from urllib.parse import unquote, urlsplit

from convergenced.core.locations import Location

__all__ = ["CHUNK", "Corrupt", "Missing", "Throttle", "Unreadable", "measure"]

CHUNK: Final = 1 << 20
"""Bytes read at once; also the throttle's granularity."""
SHARD_MAGIC: Final = b"CVGSHARD1 "
"""The first bytes of a shard file (`convergenced.integrations.shards.MAGIC`)."""
MAX_SHARD_HEADER: Final = 64 * 1024
"""A shard header line longer than this is corrupt (`shards.MAX_HEADER_BYTES`)."""


class Missing(Exception):
    """The bytes are gone: no file or object at the location (evidence: retracted)."""


class Corrupt(Exception):
    """The bytes are there but not in the shape their kind has (evidence: retracted)."""


class Unreadable(Exception):
    """The bytes could not be read, for a reason that says nothing against them."""


class Throttle:
    """A token bucket shared by the reads of one verifier: at most ``bytes_per_s`` on
    average, in bursts of at most one second's worth (thread-safe; monotonic clock:
    this runs in worker threads, outside trio)."""

    def __init__(
        self,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.rate = float(bytes_per_s)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.rate
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes may be read."""
        if self.rate <= 0:
            return  # no cap
        with self._lock:
            now = self._clock()
            self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


@contextmanager
def _open(url: str) -> Iterator[IO[bytes]]:
    parts = urlsplit(url)
    try:
        if parts.scheme == "file":
            f: IO[bytes] = open(unquote(parts.path), "rb")  # noqa: SIM115 - closed below
        else:
            f = _fsspec_open(url)
    except FileNotFoundError:
        raise Missing(f"{url}: not found") from None
    except IsADirectoryError:
        raise Corrupt(f"{url}: a directory, not a file") from None
    except OSError as exc:
        raise Unreadable(f"{url}: {exc.strerror or exc}") from None
    with f:
        yield f


def _fsspec_open(url: str) -> IO[bytes]:
    try:
        import fsspec  # type: ignore[import-untyped]  # the s3 extra brings it
    except ImportError:
        raise Unreadable(f"{url}: no reader for this scheme (install fsspec)") from None
    try:
        opened: IO[bytes] = fsspec.open(url, "rb").open()
    except (ImportError, ValueError) as exc:  # no filesystem for the scheme, or a bad URL
        raise Unreadable(f"{url}: {exc}") from None
    return opened


def _join(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name


class _Sink:
    """Where a drill restores the bytes it reads (None: nowhere, only hashed)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f: IO[bytes] | None = None

    def __enter__(self) -> _Sink:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "wb")
        return self

    def write(self, data: bytes) -> None:
        if self._f is not None:
            self._f.write(data)

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()


def _copy(f: IO[bytes], h: hashlib._Hash, throttle: Throttle, sink: _Sink) -> int:
    total = 0
    while True:
        throttle.take(CHUNK)
        chunk = f.read(CHUNK)
        if not chunk:
            return total
        h.update(chunk)
        sink.write(chunk)
        total += len(chunk)


def _shard(loc: Location, throttle: Throttle, into: Path | None) -> tuple[str, int]:
    with _open(loc.url) as f, _Sink(None if into is None else into / "shard") as sink:
        throttle.take(MAX_SHARD_HEADER)
        head = f.read(len(SHARD_MAGIC))
        if head != SHARD_MAGIC:
            raise Corrupt(f"{loc.url}: not a shard file (no CVGSHARD1 header)")
        line = _header_line(f)
        if not line.endswith(b"\n"):
            raise Corrupt(f"{loc.url}: the shard header has no end")
        sink.write(head + line)
        h = hashlib.sha256()
        return _finish(h, _copy(f, h, throttle, sink))


def _header_line(f: IO[bytes]) -> bytes:
    """The rest of the header line, newline included, at most `MAX_SHARD_HEADER` bytes
    (fsspec's files take no limit in ``readline``: read a byte at a time, as the
    header is short and the file buffered)."""
    out = bytearray()
    while len(out) < MAX_SHARD_HEADER:
        b = f.read(1)
        if not b:
            break
        out += b
        if b == b"\n":
            break
    return bytes(out)


def _finish(h: hashlib._Hash, size: int) -> tuple[str, int]:
    return f"sha256:{h.hexdigest()}", size


def _files(loc: Location, throttle: Throttle, into: Path | None) -> tuple[str, int]:
    h = hashlib.sha256()
    total = 0
    for name in sorted(loc.names):
        with _open(_join(loc.url, name)) as f, _Sink(None if into is None else into / name) as sink:
            size = f.seek(0, os.SEEK_END)
            f.seek(0)
            h.update(name.encode() + b"\0" + size.to_bytes(8, "big"))
            read = _copy(f, h, throttle, sink)
        if read != size:
            raise Unreadable(f"{_join(loc.url, name)}: changed while it was read")
        total += size
    return _finish(h, total)


def measure(loc: Location, throttle: Throttle, into: Path | None = None) -> tuple[str, int]:
    """``("sha256:<hex>", size)`` of the bytes at ``loc``, by its kind's recipe; with
    ``into``, a folder, the bytes are restored there as they are read (a shard as
    ``into/shard``, files under their names).

    Raises:
        Missing: a file or object is not there.
        Corrupt: a shard file without its header.
        Unreadable: it could not be read (no reader, permissions, the network), or
            written into ``into``.
    """
    try:
        if loc.kind == "shard":
            return _shard(loc, throttle, into)
        return _files(loc, throttle, into)
    except (Missing, Corrupt, Unreadable):
        raise
    except OSError as exc:  # reading mid-way, or writing the restored copy
        raise Unreadable(f"{loc.url}: {exc}") from None
