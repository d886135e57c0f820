"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``, DCP), committed to
the local daemon so every rank restores the same step, and only a step it can load.

DCP saves one directory per step; a crash mid-save leaves a directory with some
ranks' files and no metadata, or, with ``use_collectives=False``, some ranks' metadata
and not others'. DCP's loader and torchtitan pick a step by the presence of a metadata
file; `DcpCheckpointer` instead commits each rank's part once it is durable and the
step loadable, and loads the step the daemon agrees on::

    import torch.distributed.checkpoint as dcp
    from convergenced.client import Client
    from convergenced.integrations.dcp import DcpCheckpointer

    SPEC = {"name": "job", "members": {"node-1": [0, 1]},
            "policy": {"mode": "any", "domains": ["fs"]}, "shared": ["fs"]}
    ckpt = DcpCheckpointer(Client(), SPEC, rank, "/mnt/ckpt/job", domain="fs")
    try:
        step = ckpt.load(state)        # the launch's agreed step, or NoRestorePointError
    except NoRestorePointError:
        step = 0
    ...
    ckpt.save(state, step)             # or ckpt.async_save(state, step)
    ckpt.gc()                          # delete exactly what the daemon says is safe

**When a rank commits** (`convergenced.integrations.dcp_writer`): with global
metadata a non-coordinator rank commits once its files are durable, the coordinator
once ``.metadata`` is written, fsynced, renamed and its directory fsynced; with
``use_collectives=False`` each rank once its own ``__<rank>.metadata`` is durable.
The daemon's agreement needs every member rank, so no step is restorable before its
metadata is durable, and no collective is added to the save. Each commit carries the
size of the rank's files and their digest (`convergenced.integrations.dcp_storage`:
SHA-256 over the rank's files in name order; one read of them after the save).

**On open** the checkpointer declares the spec for the launch (as
`convergenced.integrations.files.CheckpointStore` does) and commits again every step
under ``root`` it finds complete (`convergenced.integrations.dcp_layout`), so a daemon
that lost its state, or a relaunch, learns what is there. In a domain the spec
declares ``shared`` that includes steps another world saved (PROTOCOL.md 8.1: judged
complete for the world that saved it, never against this one): a relaunch with fewer
or more ranks loads them, DCP resharding them, as far as DCP can (global metadata
only: with per-rank metadata each rank reads its own ``__<rank>.metadata``, so only a
world of the same size loads it). In a node-local domain only steps saved by a world
of this size count.

**GC.** `DcpCheckpointer.gc` deletes only steps in the daemon's ``safe_to_delete``,
and each rank deletes only its own files, after retiring its own part: the daemon
keeps one fact per rank, so a file is never deleted before its owner's part was
retired, and a rank that crashed half way finds its leftovers refused (``retired``)
and deletes them. Rank 0 deletes ``.metadata`` before its data files, so a step
stops looking loadable before anything it names is gone; the last rank out removes
the directory.

**Limits.** ``rank`` is the rank in the process group that saves (DCP names files by
it). ``dcp.async_save`` with the thread executor (the default) only: the process
executor pickles the writer into another process. The metadata is a pickle, read as
DCP reads it: trust the storage you point it at.

**Overhead.** `save` and `async_save` time what the training loop waits for (all of
a save; the staging of an asynchronous one) and report it to the daemon, best effort
(`convergenced.integrations.save_timing`): the checkpoint overhead figure of
docs/verification.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageWriter

from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec
from convergenced.integrations.dcp_layout import (
    GLOBAL_METADATA,
    DcpCompleteness,
    dcp_step_complete,
    file_rank,
    rank_metadata_name,
)
from convergenced.integrations.dcp_storage import (
    DcpStorage,
    files_digest,
    files_location,
    join,
)
from convergenced.integrations.dcp_writer import CommittingWriter
from convergenced.integrations.errors import (
    NoRestorePointError,
    RestorePointLostError,
    ShardUnavailableError,
)
from convergenced.integrations.launches import Launch, as_spec, shared_generation, shared_launch
from convergenced.integrations.save_timing import SaveTimer
from convergenced.integrations.store_api import DaemonClient, in_intervals

__all__ = [
    "DcpCheckpointer",
    "DcpDeleted",
    "NoRestorePointError",
    "RestorePointLostError",
    "ShardUnavailableError",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DcpDeleted:
    """One step `DcpCheckpointer.gc` retired this rank's part of and deleted its files."""

    epoch: int
    step_dir: str
    files: tuple[str, ...]
    """This rank's files that were deleted, in order."""
    removed_dir: bool
    """Whether the step directory is gone (this rank was the last one out)."""


def _step_pattern(step_format: str) -> re.Pattern[str]:
    if step_format.count("{epoch}") != 1 or "/" in step_format:
        raise ValueError(
            f"step_format {step_format!r}: one directory name holding {{epoch}} exactly once"
        )
    head, tail = step_format.split("{epoch}")
    return re.compile(f"^{re.escape(head)}(\\d+){re.escape(tail)}$")


_RANK_TMP = re.compile(r"^__(\d+)\.metadata\.tmp$")


class DcpCheckpointer:
    """One rank's DCP checkpoints of one stream in one domain (see the module docstring).

    Thread-safe: `async_save` commits from DCP's background thread while the training
    thread saves, loads or collects. Use it as a context manager or call `close`.
    """

    times_saves = True
    """Whether `save` and `async_save` report their time (`save_timer`); False where
    the caller times more of the save the loop waits for (torchtitan's manager)."""

    def __init__(
        self,
        client: DaemonClient,
        spec: str | StreamSpec | Mapping[str, Any],
        rank: int,
        root: str | os.PathLike[str],
        *,
        domain: str,
        launch: Launch | None = None,
        group: Any = None,
        step_format: str = "step-{epoch}",
        recommit: bool = True,
    ) -> None:
        """A checkpointer for ``rank`` saving under ``root`` in ``domain``.

        Given the stream's spec, creating it is a collective of ``group`` (rank 0 asks
        its daemon for the launch and broadcasts it, as
        `convergenced.integrations.torch.TorchCheckpointer` does) unless ``launch`` is
        given; every rank then declares the spec for the launch.

        Args:
            client: a client of this rank's node's daemon.
            spec: the stream's spec (a `StreamSpec` or the map ``declare`` takes) with
                this launch's member map; or the stream's name, declared beforehand.
            rank: this process's rank in the group that saves.
            root: the directory (a path, or an fsspec URL such as ``s3://b/run``)
                holding one step directory per epoch.
            domain: the persistence domain ``root`` is, one of the spec's policy.
            launch: the launch to declare for, when the job shares it its own way.
            group: the process group that shares the launch and new generations.
            step_format: the name of an epoch's directory under ``root``.
            recommit: commit again the complete steps found under ``root``, now and
                after each reconnect of ``client`` to a daemon that restarted.

        Raises:
            ValueError: a bad ``step_format``, a ``domain`` not in the policy, or
                ``launch`` with a stream's name.
            SpecError, ApiError, DaemonUnreachable: as `CheckpointStore`.
        """
        self._pattern = _step_pattern(step_format)
        self.step_format = step_format
        self.launch: Launch | None = None
        """The launch the spec was declared for (None: opened with the stream's name)."""
        if isinstance(spec, str):
            if launch is not None:
                raise ValueError("launch= needs the stream's spec, which it declares")
            declared = StreamSpec.from_wire(client.state(spec)["spec"])
        else:
            s = as_spec(spec)
            self.launch = launch if launch is not None else shared_launch(client, s, group=group)
            declared = self.launch.spec(s)
            if domain in declared.policy.domains:
                client.declare(declared)
        if domain not in declared.policy.domains:
            raise ValueError(
                f"domain {domain!r} is not in the policy of stream {declared.name!r} "
                f"({', '.join(declared.policy.domains)})"
            )
        self.client = client
        self.stream = declared.name
        self.rank = rank
        self.domain = domain
        self.group = group
        self.root = os.fspath(root)
        self.world = sum(len(ranks) for _, ranks in declared.members)
        """The number of ranks of this launch's member map."""
        self.shared = domain in declared.shared
        """Whether ``domain`` is readable from every host (steps of other worlds count)."""
        self._storage = DcpStorage(self.root)
        self._lock = threading.Lock()  # guards the fields below; never held across a call
        self._known: dict[int, tuple[tuple[tuple[str, int], ...], str, int]] = {}
        self._pending: list[concurrent.futures.Future[Any]] = []
        self.committed: list[int] = []
        """Epochs this rank committed from a save, in order."""
        self.skipped: list[int] = []
        """Epochs whose commit the daemon refused as retired (a step saved again after
        its deletion was allowed): not counted."""
        self.recommitted: list[int] = []
        """Epochs the last pass on open (or after a reconnect) committed."""
        self.save_timer = SaveTimer(client, self.stream, rank)
        """Times `save` and `async_save` for the checkpoint overhead figure."""
        self._hooked = False
        if recommit:
            self.recommit()
            add_hook = getattr(client, "add_reconnect_hook", None)
            if add_hook is not None:
                add_hook(self._reconnected)
                self._hooked = True

    # -- layout ---------------------------------------------------------------------------

    def checkpoint_id(self, epoch: int) -> str:
        """The step directory of ``epoch``: ``root/<step_format>``."""
        return join(self.root, self.step_format.format(epoch=epoch))

    def steps(self) -> list[int]:
        """The epochs with a step directory under ``root``, ascending."""
        found = (self._pattern.match(name) for name in self._storage.subdirs())
        return sorted(int(m.group(1)) for m in found if m)

    def complete(self, epoch: int) -> DcpCompleteness:
        """`dcp_step_complete` of ``epoch``'s step, for the world that saved it (with
        per-rank metadata, where nothing names that world, for this launch's)."""
        found = dcp_step_complete(self.checkpoint_id(epoch))
        if found.layout == "per_rank":
            found = dcp_step_complete(self.checkpoint_id(epoch), world=self.world)
        return found

    # -- committing -----------------------------------------------------------------------

    def _commit(self, epoch: int, storage: DcpStorage, names: list[str]) -> bool:
        """Commit this rank's ``names`` of ``epoch``; False when the daemon had retired it."""
        digest, size = files_digest(storage, names)
        try:
            self.client.commit(self.stream, self.rank, self.domain, epoch, digest=digest,
                               size=size, location=files_location(storage, names))  # fmt: skip
        except ApiError as exc:
            if exc.reason != "retired":
                raise
            log.warning("stream %r rank %d: step %d was retired: not committed", self.stream,
                        self.rank, epoch)  # fmt: skip
            with self._lock:
                self.skipped.append(epoch)
            return False
        present = storage.files() or {}
        with self._lock:
            self._known[epoch] = (tuple((n, present.get(n, -1)) for n in names), digest, size)
        return True

    def recommit(self) -> list[int]:
        """Commit again every complete step under ``root`` with a part of this rank.

        A step counts when `complete` says so and, in a node-local domain, a world of
        this launch's size saved it. Digests are read again only for a step whose
        files changed size since this checkpointer last hashed them. A step the daemon
        says this rank retired has its leftovers deleted.

        Returns:
            The epochs committed.

        Raises:
            ApiError: the daemon refused a commit for another reason than ``retired``.
            DaemonUnreachable: the daemon cannot be reached.
        """
        done: list[int] = []
        for epoch in self.steps():
            found = self.complete(epoch)
            if not found.ok:
                log.info("step %s not committed: %s", found.step_dir, "; ".join(found.problems))
                continue
            if not self.shared and found.saving_world != self.world:
                continue  # node-local: only what a world like this one saved here
            names = [f.name for f in found.rank_files(self.rank)]
            fingerprint = tuple((f.name, f.present or 0) for f in found.rank_files(self.rank))
            with self._lock:
                known = self._known.get(epoch)
            storage = DcpStorage(found.step_dir)
            if known is not None and known[0] == fingerprint:
                try:
                    self.client.commit(self.stream, self.rank, self.domain, epoch,
                                       digest=known[1], size=known[2],
                                       location=files_location(storage, names))  # fmt: skip
                except ApiError as exc:
                    if exc.reason != "retired":
                        raise
                    self._delete_own(epoch)
                    continue
            elif not self._commit(epoch, storage, names):
                self._delete_own(epoch)
                continue
            done.append(epoch)
        if done:
            log.info("stream %r rank %d: committed %d step(s) again: %s", self.stream,
                     self.rank, len(done), done)  # fmt: skip
        self.recommitted = done
        return done

    def _reconnected(self, info: object) -> None:
        # On the client's reconnecting thread, before other calls go through: only
        # this client's calls, no lock held across them.
        self.recommit()

    # -- saving ---------------------------------------------------------------------------

    def writer(self, epoch: int, inner: StorageWriter | None = None) -> CommittingWriter:
        """A storage writer for ``epoch`` that commits this rank's part once loadable.

        Args:
            inner: DCP's writer to wrap, for ``checkpoint_id(epoch)`` (None: a
                ``FileSystemWriter`` for a path, an ``FsspecWriter`` for a URL).

        Raises:
            ValueError: ``inner`` writes somewhere else.
        """
        where = self.checkpoint_id(epoch)
        if inner is None:
            if "://" in where:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                inner = FsspecWriter(where)
            else:
                inner = FileSystemWriter(where)
        else:
            theirs = os.fspath(getattr(inner, "checkpoint_id", "")).rstrip("/")
            if theirs != where.rstrip("/"):
                raise ValueError(f"the writer saves to {theirs!r}, epoch {epoch} is {where!r}")
        storage = DcpStorage(where)

        def commit(names: list[str]) -> None:
            if self._commit(epoch, storage, names):
                with self._lock:
                    self.committed.append(epoch)

        return CommittingWriter(inner, storage.make_durable, commit)

    def save(self, state_dict: dict[str, Any], epoch: int, **dcp_kwargs: Any) -> Metadata:
        """``dcp.save`` of ``state_dict`` as ``epoch`` through `writer` (every rank).

        ``storage_writer=`` in ``dcp_kwargs`` is wrapped; the others go to ``dcp.save``.
        """
        w = self.writer(epoch, dcp_kwargs.pop("storage_writer", None))
        with self._timed():
            metadata: Metadata = dcp_save(state_dict, storage_writer=w, **dcp_kwargs)
        return metadata

    def _timed(self) -> AbstractContextManager[None]:
        """`SaveTimer.timing`, unless a caller times the save itself (`times_saves`)."""
        return self.save_timer.timing() if self.times_saves else nullcontext()

    def async_save(self, state_dict: dict[str, Any], epoch: int, **dcp_kwargs: Any) -> Any:
        """``dcp.async_save`` through `writer`: the commits happen on DCP's thread once the
        background save finished (a failed one commits nothing of this rank).

        Returns:
            What ``dcp.async_save`` returns (a future, or an ``AsyncSaveResponse``).
        """
        w = self.writer(epoch, dcp_kwargs.pop("storage_writer", None))
        with self._timed():  # what the loop waits for: the staging, not the upload
            result = dcp_async_save(state_dict, storage_writer=w, **dcp_kwargs)
        fut = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        return result

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the async saves started so far; raises the first one's error."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            fut.result(timeout)

    # -- loading ------------------------------------------------------------------------

    def generation(self, timeout: float | None = None) -> int:
        """The launch's recovery generation, or (opened with a name) a new one shared by
        rank 0 of the group."""
        if self.launch is not None:
            return self.launch.generation
        return shared_generation(self.client, self.stream, group=self.group, timeout=timeout)

    def agreed_epoch(self, generation: int | None = None, timeout: float | None = None) -> int:
        """The restore point of ``generation`` (None: `generation`), as the daemon answers.

        Raises:
            NoRestorePointError: the generation has no restore point.
            RestorePointLostError: its restore point was retracted since.
            ApiError: kind ``timeout`` when not every member asked within ``timeout``.
        """
        if generation is None:
            generation = self.generation(timeout)
        answer = self.client.restore_point(self.stream, generation, timeout)
        if not answer.get("resolved", False):
            raise ApiError(ErrorKind.TIMEOUT, "timeout",
                           f"generation {generation} unresolved, waiting for "
                           f"{answer.get('waiting_for')}")  # fmt: skip
        epoch = answer.get("restore_point")
        if epoch is None:
            raise NoRestorePointError(self.stream, generation)
        if answer.get("lost"):
            raise RestorePointLostError(self.stream, generation, int(epoch))
        return int(epoch)

    def load(
        self,
        state_dict: dict[str, Any],
        generation: int | None = None,
        *,
        timeout: float | None = None,
        **dcp_kwargs: Any,
    ) -> int:
        """``dcp.load`` of the agreed step of ``generation`` into ``state_dict``.

        Loads exactly that step or raises, never another one. A step found incomplete
        (deleted or damaged since it was agreed) is retracted for this rank first.

        Returns:
            The epoch loaded.

        Raises:
            NoRestorePointError: no step is restorable on every member: start fresh.
            RestorePointLostError: the agreed step was retracted since.
            ShardUnavailableError: the step is no longer complete (retracted; ask
                again with a newer generation).
            ApiError: see `agreed_epoch`.
        """
        epoch = self.agreed_epoch(generation, timeout)
        found = self.complete(epoch)
        if not found.ok:
            try:
                self.client.retract(self.stream, self.rank, self.domain, epoch)
            except ApiError as exc:
                if exc.kind is not ErrorKind.REJECTED:
                    raise
            raise ShardUnavailableError(self.stream, self.rank, epoch, found.problems)
        dcp_load(state_dict, checkpoint_id=self.checkpoint_id(epoch), **dcp_kwargs)
        return epoch

    # -- garbage collection -----------------------------------------------------------------

    def _own_files(self, names: Iterable[str]) -> list[str]:
        """This rank's files among ``names``, in deletion order: the metadata first."""
        own = [n for n in names if file_rank(n) == self.rank and n != GLOBAL_METADATA]
        if self.rank == 0:
            own += [n for n in names if n in (GLOBAL_METADATA, f"{GLOBAL_METADATA}.tmp")]
            # Ranks a larger world had and this one has not: nobody else will.
            own += [n for n in names if (r := file_rank(n)) is not None and r >= self.world]
            own += [n for n in names if (m := _RANK_TMP.match(n)) and int(m.group(1)) >= self.world]
        own += [n for n in names if n == f"{rank_metadata_name(self.rank)}.tmp"]

        def order(name: str) -> tuple[int, str]:
            return (0 if ".metadata" in name else 1, name)

        return sorted(set(own), key=order)

    def _delete_own(self, epoch: int) -> DcpDeleted:
        step = DcpStorage(self.checkpoint_id(epoch))
        names = self._own_files((step.files() or {}).keys())
        removed = [n for n in names if step.remove(n)]
        with self._lock:
            self._known.pop(epoch, None)
        gone = step.remove_dir_if_empty()
        if not gone and step.local is not None:
            step.make_durable([])  # the names removed, durably
        return DcpDeleted(epoch, step.where, tuple(removed), gone)

    def gc(self) -> list[DcpDeleted]:
        """Delete this rank's files of the steps the daemon says are safe to delete.

        For each step in the state's ``safe_to_delete`` holding files of this rank:
        retire this rank's part, then delete its files (see the module docstring for
        why each rank deletes its own); a step the daemon refuses to retire (it became
        protected meanwhile) is kept.

        Returns:
            What was deleted.
        """
        safe = self.client.state(self.stream).get("safe_to_delete") or []
        deleted: list[DcpDeleted] = []
        if not safe:
            return deleted
        for epoch in self.steps():
            if not in_intervals(epoch, safe):
                continue
            files = DcpStorage(self.checkpoint_id(epoch)).files() or {}
            if not self._own_files(files):
                continue
            try:
                self.client.retire(self.stream, self.rank, self.domain, epoch)
            except ApiError as exc:
                if exc.reason == "not_safe_to_delete":
                    continue
                raise
            deleted.append(self._delete_own(epoch))
        return deleted

    # -- closing --------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> None:
        """Wait for the async saves, and stop committing again after reconnects."""
        try:
            self.wait(timeout)
        finally:
            if self._hooked:
                remove = getattr(self.client, "remove_reconnect_hook", None)
                if remove is not None:
                    remove(self._reconnected)
                self._hooked = False

    def __enter__(self) -> DcpCheckpointer:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
