"""The errors of the checkpoint integrations, all under `CheckpointError`.

Why a module of their own: the shard format (`convergenced.integrations.shards`), the
store (`convergenced.integrations.files`) and the PyTorch integration
(`convergenced.integrations.torch`) raise them, and a training job tells them apart by
class (`NoRestorePointError`: start fresh; `ShardUnavailableError` and
`RestorePointLostError`: ask for the restore point of a newer generation). Living
below all three, they are one hierarchy whichever module raised them; ``files`` and
``torch`` re-export them, so a job imports them from the module it uses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from convergenced.errors import ConvergencedError

__all__ = [
    "CheckpointError",
    "CorruptShardError",
    "MixedEpochError",
    "NoRestorePointError",
    "RestorePointLostError",
    "ShardUnavailableError",
    "UploadError",
]


class CheckpointError(ConvergencedError):
    """Base class of the errors of the files integration."""


class CorruptShardError(CheckpointError):
    """A shard file is unreadable, torn, or its header or digest does not match."""

    def __init__(self, path: Path | str | None, why: str) -> None:
        where = str(path) if path is not None else "shard"
        super().__init__(f"{where}: corrupt shard: {why}")
        self.path = path
        self.why = why


class ShardUnavailableError(CheckpointError):
    """No tier holds a valid shard of the requested epoch for this rank.

    Every missing or corrupt copy was retracted; the job should ask for the restore
    point of a newer recovery generation (which will be an older, intact epoch).
    """

    def __init__(self, stream: str, rank: int, epoch: int, reasons: Sequence[str]) -> None:
        detail = "; ".join(reasons) if reasons else "no tier configured"
        super().__init__(
            f"stream {stream!r} rank {rank}: no valid shard of epoch {epoch} in any tier "
            f"({detail}); ask for the restore point of a newer generation"
        )
        self.stream = stream
        self.rank = rank
        self.epoch = epoch
        self.reasons = tuple(reasons)


class MixedEpochError(CheckpointError):
    """Shards of different epochs (or streams) were about to be assembled into one state."""

    def __init__(self, message: str, epochs: Mapping[int, int]) -> None:
        super().__init__(message)
        self.epochs = dict(epochs)
        """rank -> epoch of the shards that were offered."""


class NoRestorePointError(CheckpointError):
    """The daemon says the generation has no epoch every member can restore: start fresh."""

    def __init__(self, stream: str, generation: int) -> None:
        super().__init__(
            f"stream {stream!r}: recovery generation {generation} has no restore point "
            "(no epoch is recoverable on every member at or above the rollback floor); "
            "start from scratch"
        )
        self.stream = stream
        self.generation = generation


class RestorePointLostError(CheckpointError):
    """The generation's restore point was retracted since it was chosen."""

    def __init__(self, stream: str, generation: int, epoch: int) -> None:
        super().__init__(
            f"stream {stream!r}: restore point {epoch} of generation {generation} was lost "
            "(retracted since); ask for the restore point of a newer generation"
        )
        self.stream = stream
        self.generation = generation
        self.epoch = epoch


class UploadError(CheckpointError):
    """One or more background uploads failed (raised by `CheckpointStore.flush`)."""

    def __init__(self, failures: Sequence[tuple[int, BaseException]]) -> None:
        parts = ", ".join(f"epoch {e}: {exc}" for e, exc in failures)
        super().__init__(f"{len(failures)} upload(s) failed: {parts}")
        self.failures = tuple(failures)
