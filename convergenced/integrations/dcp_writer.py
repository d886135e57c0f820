"""The DCP storage writer that commits a rank's step once it can be loaded.

`CommittingWriter` wraps DCP's own writer (``FileSystemWriter``, ``FsspecWriter`` or
any `StorageWriter`) and delegates every call to it; it only watches two of them:

- ``write_data``: once the inner writer's future completes, the rank's files (the
  ones its ``WriteResult`` name) are made durable with their directory
  (`convergenced.integrations.dcp_storage.DcpStorage.make_durable`). With global
  metadata (``use_collectives=True``) a non-coordinator rank commits then: DCP offers
  it no later hook, and its commit cannot make the step restorable by itself, since
  the agreement needs every member rank, the coordinator included.
- ``finish``: the coordinator (with global metadata) or every rank (with per-rank
  metadata, where each rank runs its own ``finish``) lets the inner writer write the
  metadata (temporary file, fsync, rename), makes it and the directory durable, and
  commits only then.

So no rank's commit completes the agreement before the metadata that makes the step
loadable is durable, and nothing is added to DCP's collectives. A save that fails
on this rank (an exception in ``write_data`` or ``finish``, a crash) commits nothing
from this rank; with ``dcp.async_save`` all of this runs on DCP's background thread
(`convergenced.client.Client` is thread-safe).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from convergenced.integrations.dcp_layout import GLOBAL_METADATA, rank_metadata_name

__all__ = ["CommittingWriter"]

Commit = Callable[[list[str]], None]
"""Called with the names of the rank's durable files, metadata included if it wrote one."""


class CommittingWriter(StorageWriter):
    """Delegates to ``inner`` and calls ``commit`` once the rank's step is loadable
    (see the module docstring)."""

    def __init__(
        self,
        inner: StorageWriter,
        make_durable: Callable[[list[str]], None],
        commit: Commit,
    ) -> None:
        """Wrap ``inner``; ``make_durable(names)`` fsyncs files of the step directory."""
        super().__init__()
        self.inner = inner
        """The writer that does the writing."""
        self._make_durable = make_durable
        self._commit = commit
        self._coordinator = False
        self._rank: int | None = None
        self._collectives = True
        self._written: list[str] = []
        self.committed = False
        """Whether this rank's commit of the step was sent and acknowledged."""

    def __getattr__(self, name: str) -> Any:
        # Attributes of the inner writer (path, fs, sync_files...) read through.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        """The inner writer's checkpoint id (its step directory)."""
        checkpoint_id: str | os.PathLike[str] = self.inner.checkpoint_id  # type: ignore[attr-defined]
        return checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save through the same writer: only to the same step directory."""
        if checkpoint_id and os.fspath(checkpoint_id) != os.fspath(self.checkpoint_id):
            raise ValueError(
                f"this writer saves to {os.fspath(self.checkpoint_id)}, not "
                f"{os.fspath(checkpoint_id)}: ask the checkpointer for that epoch's writer"
            )
        self._written, self.committed = [], False
        self.inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Note the rank's role (DCP passes ``rank`` and ``use_collectives``)."""
        self._coordinator = is_coordinator
        self._rank = kwargs.get("rank")
        self._collectives = bool(kwargs.get("use_collectives", True))
        if "kwargs" in inspect.signature(self.inner.set_up_storage_writer).parameters:
            self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:
            self.inner.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The inner writer's."""
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The inner writer's."""
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """The inner writer's ``write_data``, waited for; then the rank's files are
        made durable, and a non-coordinator rank with global metadata commits."""
        results = self.inner.write_data(plan, planner).wait()  # DCP waits right after
        names = sorted({r.storage_data.relative_path for r in results})
        self._make_durable(names)
        self._written = names
        if self._collectives and not self._coordinator:
            self._commit(names)
            self.committed = True
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The inner writer's ``finish`` (the metadata), made durable, then the commit."""
        self.inner.finish(metadata, results)
        if self._collectives or self._rank is None:
            name = GLOBAL_METADATA
        else:
            name = rank_metadata_name(self._rank)
        self._make_durable([name])
        self._commit(sorted({*self._written, name}))
        self.committed = True

    def storage_meta(self) -> StorageMeta | None:
        """The inner writer's."""
        return self.inner.storage_meta()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen by DCP for a bare checkpoint id: it is built for one epoch."""
        return False
