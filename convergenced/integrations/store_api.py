"""What a `convergenced.integrations.files.CheckpointStore` takes and returns: its
tiers (`StorageTier`, what the store needs of one, and `Tier`, a directory), the
result of a restore (`Restored`) and of a deletion (`Deleted`), and what it needs of
a client (`DaemonClient`). Re-exported by `convergenced.integrations.files`, which is
where jobs import them from; the object-store tier is
`convergenced.integrations.objectstore.ObjectTier`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeAlias

from convergenced import fsutil
from convergenced.core.spec import StreamSpec
from convergenced.integrations.errors import CorruptShardError
from convergenced.integrations.shards import (
    _EPOCH_DIR,
    Payload,
    Shard,
    _stream_dir,
    decode_shard,
    shard_path,
)

__all__ = [
    "DaemonClient",
    "Deleted",
    "Location",
    "Restored",
    "StorageTier",
    "Tier",
    "in_intervals",
    "read_from",
]


def in_intervals(epoch: int, intervals: Iterable[Sequence[int]]) -> bool:
    """Whether ``epoch`` lies in a ``state`` reply's list of ``[lo, hi]`` ranges
    (``safe_to_delete``, ``recoverable``), bounds included."""
    return any(lo <= epoch <= hi for lo, hi in intervals)


Location: TypeAlias = Path | str
"""Where a shard lives: a file's path, or an object's URL (``s3://bucket/key``)."""


class StorageTier(Protocol):
    """What a `CheckpointStore` needs of a tier: one persistence domain and the store
    that holds its shards, one per (stream, epoch, rank).

    `Tier` is a directory; `convergenced.integrations.objectstore.ObjectTier` an S3
    bucket. Every method may be called from the store's uploader thread.
    """

    @property
    def domain(self) -> str:
        """The domain name committed to the daemon (``nvme``, ``s3``...)."""
        ...

    def locate(self, stream: str, epoch: int, rank: int) -> Location:
        """Where the shard of ``rank`` of ``epoch`` lives (reported, never parsed)."""
        ...

    def write(self, stream: str, epoch: int, rank: int, data: bytes) -> None:
        """Store a shard file's bytes, complete or not at all: once this returns they
        are durable; if it raises, or the process dies in it, the shard's name holds
        its earlier content or nothing, never part of ``data``."""
        ...

    def read(self, stream: str, epoch: int, rank: int) -> bytes:
        """The bytes of the shard. Raises FileNotFoundError if there is none, another
        OSError if it cannot be read."""
        ...

    def stamp(self, stream: str, epoch: int, rank: int) -> Hashable | None:
        """A value that changes whenever the shard is rewritten (None: there is none),
        so the store reads again only what changed."""
        ...

    def epochs(self, stream: str, rank: int) -> list[int]:
        """The epochs for which ``rank`` has a shard here, ascending."""
        ...

    def delete(self, stream: str, epoch: int, rank: int) -> None:
        """Remove the shard (nothing if there is none)."""
        ...

    def sweep(self, stream: str, rank: int) -> list[Location]:
        """Remove what writes of ``rank`` cut short by a crash left behind (never a
        shard), in other processes only; return what was removed."""
        ...


@dataclass(frozen=True, init=False)
class Tier:
    """One persistence domain and the directory that holds its shards (a `StorageTier`).

    A shard is ``<directory>/<stream>/epoch-<E>/rank-<R>.shard``: written to a
    temporary file in the same directory, fsynced, renamed to its final name, and the
    directory fsynced, so a crash leaves the old state or the complete new file.
    """

    domain: str
    """The domain name committed to the daemon (``nvme``, ``s3``...)."""
    directory: Path
    """The root directory; shards live under ``<directory>/<stream>/``."""

    def __init__(self, domain: str, directory: str | os.PathLike[str]) -> None:
        """A tier ``domain`` stored under ``directory``."""
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "directory", Path(directory))

    def locate(self, stream: str, epoch: int, rank: int) -> Path:
        """The shard file's path."""
        return shard_path(self.directory, stream, epoch, rank)

    def write(self, stream: str, epoch: int, rank: int, data: bytes) -> None:
        """Temporary file, fsync, rename, fsync of the directories it created."""
        fsutil.write_atomic(self.locate(stream, epoch, rank), data, make_parents=True)

    def read(self, stream: str, epoch: int, rank: int) -> bytes:
        """The file's bytes."""
        return self.locate(stream, epoch, rank).read_bytes()

    def stamp(self, stream: str, epoch: int, rank: int) -> tuple[int, int, int] | None:
        """The file's size, modification time (ns) and inode."""
        try:
            st = os.stat(self.locate(stream, epoch, rank))
        except FileNotFoundError:
            return None
        return (st.st_size, st.st_mtime_ns, st.st_ino)

    def epochs(self, stream: str, rank: int) -> list[int]:
        """The epoch directories holding a shard file of ``rank``, ascending."""
        root = self.directory / _stream_dir(stream)
        found: list[int] = []
        try:
            with os.scandir(root) as it:
                entries = list(it)
        except FileNotFoundError:
            return found
        for entry in entries:
            m = _EPOCH_DIR.match(entry.name)
            if m and os.path.isfile(os.path.join(entry.path, f"rank-{rank}.shard")):
                found.append(int(m.group(1)))
        return sorted(found)

    def delete(self, stream: str, epoch: int, rank: int) -> None:
        """Unlink the file, then the epoch directory once every rank left it."""
        path = self.locate(stream, epoch, rank)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        with contextlib.suppress(OSError):
            fsutil.fsync_dir(path.parent.parent)

    def sweep(self, stream: str, rank: int) -> list[Location]:
        """Remove the temporary files of ``rank``'s shards left by other processes.

        A crash between writing a temporary file and renaming it leaves it behind; it
        was never committed, so nothing refers to it, but its epoch directory could
        never be removed with it there. This process's own may be in use.
        """
        removed: list[Location] = []
        base = self.directory / _stream_dir(stream)
        for epoch_dir in sorted(base.glob("epoch-*")):
            for tmp in fsutil.temp_files(epoch_dir / f"rank-{rank}.shard"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                    removed.append(tmp)
        return removed


def read_from(tier: StorageTier, stream: str, epoch: int, rank: int) -> Shard:
    """Read and verify a shard of ``tier`` (`shards.read_shard`, for any tier).

    Raises:
        FileNotFoundError: the tier holds no such shard.
        CorruptShardError: it cannot be read or does not verify.
    """
    where = tier.locate(stream, epoch, rank)
    try:
        data = tier.read(stream, epoch, rank)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptShardError(where, f"cannot read: {exc}") from None
    return decode_shard(data, path=where, domain=tier.domain, stream=stream, rank=rank, epoch=epoch)


class Restored(NamedTuple):
    """What `CheckpointStore.restore` returns: the agreed epoch and this rank's payload."""

    epoch: int
    payload: Payload


@dataclass(frozen=True)
class Deleted:
    """One shard `CheckpointStore.gc` retired and deleted."""

    domain: str
    epoch: int
    path: Location


class DaemonClient(Protocol):
    """What the store needs of a client (`convergenced.client.Client` has it)."""

    def declare(self, spec: StreamSpec | Mapping[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def commit(
        self,
        stream: str,
        rank: int,
        domain: str,
        epoch: int,
        *,
        digest: str = "",
        size: int = 0,
        location: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]: ...

    def retract(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def retire(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def state(self, stream: str) -> dict[str, Any]: ...

    def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]: ...

    def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]: ...
