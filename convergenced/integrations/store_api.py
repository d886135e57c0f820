"""What a `convergenced.integrations.files.CheckpointStore` takes and returns: its
tiers (`Tier`), the result of a restore (`Restored`) and of a deletion (`Deleted`),
and what it needs of a client (`DaemonClient`). Re-exported by
`convergenced.integrations.files`, which is where jobs import them from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from convergenced.core.spec import StreamSpec
from convergenced.integrations.shards import Payload

__all__ = ["DaemonClient", "Deleted", "Restored", "Tier"]


@dataclass(frozen=True, init=False)
class Tier:
    """One persistence domain and the directory that holds its shards."""

    domain: str
    """The domain name committed to the daemon (``nvme``, ``s3``...)."""
    directory: Path
    """The root directory; shards live under ``<directory>/<stream>/``."""

    def __init__(self, domain: str, directory: str | os.PathLike[str]) -> None:
        """A tier ``domain`` stored under ``directory``."""
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "directory", Path(directory))


class Restored(NamedTuple):
    """What `CheckpointStore.restore` returns: the agreed epoch and this rank's payload."""

    epoch: int
    payload: Payload


@dataclass(frozen=True)
class Deleted:
    """One shard `CheckpointStore.gc` retired and deleted."""

    domain: str
    epoch: int
    path: Path


class DaemonClient(Protocol):
    """What the store needs of a client (`convergenced.client.Client` has it)."""

    def declare(self, spec: StreamSpec | Mapping[str, Any]) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def commit(
        self, stream: str, rank: int, domain: str, epoch: int, *, digest: str = "", size: int = 0
    ) -> dict[str, Any]: ...

    def retract(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def retire(self, stream: str, rank: int, domain: str, epoch: int) -> dict[str, Any]: ...

    def state(self, stream: str) -> dict[str, Any]: ...

    def restore_point(
        self, stream: str, generation: int, timeout: float | None = None
    ) -> dict[str, Any]: ...

    def next_generation(self, stream: str, timeout: float | None = None) -> dict[str, Any]: ...
