"""Framework-free, epoch-aware checkpoints of bytes, committed to the local daemon.

A `CheckpointStore` saves one rank's shard of each checkpoint epoch to a fast
**local** tier (say NVMe) and, through a background uploader, to a slower **remote**
tier (a directory standing in for an object store). Each tier is a persistence domain
of the stream; every write that is durable is committed to the daemon for its domain,
so the daemon knows, per domain, what this rank can restore::

    from convergenced.client import Client
    from convergenced.integrations.files import CheckpointStore, Tier

    SPEC = {
        "name": "job",
        "members": {"node-1": [0]},  # this launch's hosts: node id -> its ranks
        "policy": {"mode": "any", "domains": ["nvme", "s3"]},
        "shared": ["s3"],  # readable from any host
    }
    client = Client()
    store = CheckpointStore(  # declares SPEC for this launch, commits what the tiers hold
        client, SPEC, rank, Tier("nvme", "/nvme/ckpt"), Tier("s3", "/mnt/bucket/ckpt")
    )
    try:
        epoch, payload = store.restore()  # the launch's agreed restore point
        start = load(payload)
    except NoRestorePointError:
        start = fresh()
    for step in range(start, steps):
        train_one_step()
        if step % every == 0:
            store.save(step, state_bytes())  # local write + fsync + local commit ack
            store.gc()  # delete exactly what the daemon says is safe
    store.close()  # waits for the uploads

**On disk.** Each tier holds the shard of rank R of epoch E at
``<tier>/<stream>/epoch-<E>/rank-<R>.shard``, in the format of
`convergenced.integrations.shards`. A tier is a directory (`Tier`), where every write
goes to a temporary file in the same directory, is fsynced, renamed to its final
name, and the directory is fsynced, or an S3 bucket
(`convergenced.integrations.objectstore.ObjectTier`), where a PUT or a multipart
upload becomes visible whole when it completes: either way a crash leaves the old
state or the complete new shard, never a torn one under the final name.

**Guarantees.** `CheckpointStore.restore` returns the agreed restore point of a
recovery generation or raises: it never returns another epoch. A shard whose header
or digest does not match is reported to the daemon with ``retract`` and the other
tier is tried. `CheckpointStore.restore_all` assembles through `load_consistent`,
which refuses shards of different epochs (`MixedEpochError`). `CheckpointStore.gc`
deletes only epochs the daemon lists in ``safe_to_delete``, and retires each one
before deleting it.

**Launches.** Given the stream's spec, the store declares it for this launch (a
`convergenced.integrations.launches.Launch`: the recovery generation every rank
restores and the membership every rank declares), so a relaunch on other hosts (a
spare replaced a dead one, the job shrank or grew) declares the new member map by
itself. A stream of one rank opens its own launch; with several ranks, one rank asks
for it and every rank passes it (``launch=``), or
`convergenced.integrations.torch.TorchCheckpointer` shares it over the process group.
Given the stream's name, the store uses what the job declared itself.

**Daemon restarts, and ranks that moved.** The store opens by committing again every
shard of its rank it finds in its tiers, after verifying each one, and does it again
after its client reconnects to a daemon that restarted, so a daemon that lost its
state directory learns again what this node holds (`convergenced.integrations.recommit`
says what that costs, and why a shard the daemon says was retired is deleted). A rank
that moved to another host finds its shards in the shared remote tier the same way and
commits them on its new node (*adoption*); the local tier it opens is its new host's,
so nothing of another host's node-local storage is ever read.

This module is the store; the shard format, the errors and the store's own types (its
tiers, what it returns, what it needs of a client) live in
`convergenced.integrations.shards`, `convergenced.integrations.errors` and
`convergenced.integrations.store_api`, and the names a job needs from them are
re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from convergenced import fsutil
from convergenced.core.local_api_codec import ApiError, ErrorKind
from convergenced.core.spec import StreamSpec
from convergenced.integrations.errors import (
    CheckpointError,
    CorruptShardError,
    MixedEpochError,
    NoRestorePointError,
    RestorePointLostError,
    ShardUnavailableError,
    UploadError,
)
from convergenced.integrations.launches import (
    Launch,
    as_spec,
    new_generation,
    solo_generation,
    solo_launch,
)
from convergenced.integrations.recommit import Ledger, Recommitted
from convergenced.integrations.save_timing import SaveTimer
from convergenced.integrations.shards import (
    Payload,
    Shard,
    decode_shard,
    encode_shard,
    load_consistent,
    read_shard,
    shard_location,
    shard_path,
)
from convergenced.integrations.store_api import (
    DaemonClient,
    Deleted,
    Location,
    Restored,
    StorageTier,
    Tier,
    in_intervals,
    read_from,
)
from convergenced.integrations.uploads import Uploader

__all__ = [
    "CheckpointError",
    "CheckpointStore",
    "CorruptShardError",
    "DaemonClient",
    "Deleted",
    "Launch",
    "Location",
    "MixedEpochError",
    "NoRestorePointError",
    "Payload",
    "Recommitted",
    "RestorePointLostError",
    "Restored",
    "Shard",
    "ShardUnavailableError",
    "StorageTier",
    "Tier",
    "UploadError",
    "decode_shard",
    "encode_shard",
    "load_consistent",
    "read_shard",
    "shard_path",
    "write_atomic",
]

log = logging.getLogger(__name__)


# -- durable files --------------------------------------------------------------------


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old state or all of it.

    Temporary file in the same directory, fsync, rename over ``path``, fsync of the
    directory (and of every parent directory this call created): see
    `convergenced.fsutil.write_atomic`.
    """
    fsutil.write_atomic(path, data, make_parents=True)


# -- the store ------------------------------------------------------------------------


class CheckpointStore:
    """One rank's checkpoints of one stream on a local tier and an optional remote tier.

    `save` blocks only for the local write, its fsyncs and the local commit's
    acknowledgement; a background thread (`convergenced.integrations.uploads`) uploads
    each saved shard to the remote tier after ``upload_delay`` seconds and commits the
    remote domain. The store is
    thread-safe; use it as a context manager or call `close`.
    """

    times_saves = True
    """Whether `save` reports its time (`save_timer`); False where the caller times
    more of the save (`convergenced.integrations.torch.TorchCheckpointer`)."""

    def __init__(
        self,
        client: DaemonClient,
        stream: str | StreamSpec | Mapping[str, Any],
        rank: int,
        local: StorageTier,
        remote: StorageTier | None = None,
        *,
        launch: Launch | None = None,
        upload_delay: float | Callable[[int], float] = 0.0,
        recommit: bool = True,
    ) -> None:
        """A store for ``rank`` of ``stream``; opening it commits again what it holds.

        Args:
            client: a client of this node's daemon (`convergenced.client.Client`).
            stream: the stream's spec (a `StreamSpec`, or the map ``declare`` takes)
                with the member map of this launch, which the store declares for the
                launch before anything else; or the stream's name, declared on the
                daemon beforehand.
            rank: the rank this store saves for (hosted by this node).
            local: the fast tier, written synchronously by `save`: this host's own
                (a `Tier`, a directory).
            remote: the slow tier, written by the background uploader (None: no
                uploads); every host may share it (a `Tier` on a shared file system,
                or an `convergenced.integrations.objectstore.ObjectTier`).
            launch: the launch to declare the spec for (`launches.new_launch` on one
                rank, handed to every rank); None, with a spec: a stream of one rank
                opens its own (`launches.solo_launch`). Only with a spec.
            upload_delay: seconds each upload takes on top of the copy (a number, or a
                function of the epoch), to model an object store's lag.
            recommit: verify and commit again every shard of this rank found in the
                tiers, now and after each reconnect of ``client`` to a daemon that
                restarted (`convergenced.integrations.recommit`).

        Raises:
            CheckpointError: a spec of several ranks and no ``launch``.
            SpecError: the spec is not valid.
            ApiError: the daemon refused the declaration (``spec_conflict``,
                ``membership_superseded``...) or to take a shard found on disk again
                (say the stream is not declared: declare before opening the store).
            DaemonUnreachable: the daemon cannot be reached.
        """
        if local.domain == (remote.domain if remote is not None else None):
            raise ValueError(f"local and remote tiers share the domain {local.domain!r}")
        self.launch: Launch | None = None
        """The launch the store declared its spec for (None: opened with a name)."""
        self.spec: StreamSpec | None = None
        """The spec the store declared (None: opened with the stream's name)."""
        if isinstance(stream, str):
            if launch is not None:
                raise ValueError("launch= needs the stream's spec, which the store declares")
        else:
            spec = as_spec(stream)
            self.launch = launch if launch is not None else solo_launch(client, spec)
            self.spec = self.launch.spec(spec)
            client.declare(self.spec)  # before the commits of what the tiers hold
            stream = spec.name
        self.client = client
        self.stream = stream
        self.rank = rank
        self.local = local
        self.remote = remote
        self.save_timer = SaveTimer(client, stream, rank)
        """Times `save` for the checkpoint overhead figure (docs/verification.md)."""
        self._lock = threading.Lock()  # serializes an upload's copy + commit with gc
        self._uploads = Uploader(
            self._upload, upload_delay, name=f"convergenced-upload-{stream}-{rank}"
        )
        self._collected: set[tuple[str, int]] = set()
        self._closed = False
        self.uploaded: list[int] = []
        """Epochs uploaded and committed to the remote tier, in order (for progress)."""
        self.skipped: list[int] = []
        """Epochs `save` did not count: this rank's daemon had retired them (see `save`)."""
        self.swept = self._sweep_temp_files()
        """Temporary files of this rank left by a crash mid-write, removed at start."""
        self.ledger = Ledger(client, stream, rank, self._tier, self._listing)
        """The shards known to verify, and committing them again."""
        self.recommitted: Recommitted | None = None
        """What the last pass of committing again did (None: none ran)."""
        self._hooked = False
        if recommit:
            self.recommitted = self.ledger.recommit()
            add_hook = getattr(client, "add_reconnect_hook", None)
            if add_hook is not None:
                add_hook(self._reconnected)
                self._hooked = True

    def _reconnected(self, info: object) -> None:
        # On the client's reconnecting thread, before any other call goes through:
        # it must not wait for this store's lock (an upload may hold it, waiting for
        # the connection). The ledger never holds a lock across a request.
        if not self._closed:
            self.recommitted = self.ledger.recommit()

    def _tier(self, domain: str) -> StorageTier:
        tier = self.local if domain == self.local.domain else self.remote
        assert tier is not None and tier.domain == domain
        return tier

    def _listing(self) -> list[tuple[str, int]]:
        return [(tier.domain, epoch) for tier in self.tiers for epoch in self.epochs(tier)]

    def _sweep_temp_files(self) -> list[Location]:
        # A new store for this rank means a writer of another process that left a
        # write cut short (a temporary file, an unfinished multipart upload) is gone:
        # remove what it left, or gc could never tidy up after it (StorageTier.sweep).
        return [found for tier in self.tiers for found in tier.sweep(self.stream, self.rank)]

    # -- paths ----------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[StorageTier, ...]:
        """The tiers in the order restore tries them: local, then remote."""
        return (self.local,) if self.remote is None else (self.local, self.remote)

    def path(self, tier: StorageTier, epoch: int, rank: int | None = None) -> Location:
        """The shard of ``epoch`` for ``rank`` (default: this store's) in ``tier``: a
        file's path in a `Tier`, an object's URL in an object-store tier."""
        return tier.locate(self.stream, epoch, self.rank if rank is None else rank)

    def epochs(self, tier: StorageTier) -> list[int]:
        """The epochs for which this rank has a shard in ``tier``, ascending."""
        return tier.epochs(self.stream, self.rank)

    # -- saving -----------------------------------------------------------------------

    def save(self, epoch: int, payload: Payload) -> Shard:
        """Save this rank's shard of ``epoch`` durably to the local tier and commit it.

        Returns once the shard is fsynced under its final name and the daemon has
        acknowledged the commit (durable in its log). The upload to the remote tier,
        if any, happens in the background.

        An epoch the daemon retired (a job gone back to an older epoch or to scratch)
        is not counted again: its shard is removed, the epoch added to `skipped`, a
        warning logged, and the shard returned has ``committed`` false.

        Raises:
            ApiError: the daemon refused the commit (unknown stream, unknown rank...).
            DaemonUnreachable: the daemon cannot be reached within the reconnect bound.
            OSError: the local write failed (nothing was committed).
        """
        if not self.times_saves:
            return self._save(epoch, payload)
        with self.save_timer.timing():  # the write, fsync and commit the loop waits for
            return self._save(epoch, payload)

    def _save(self, epoch: int, payload: Payload) -> Shard:
        if self._closed:
            raise CheckpointError("the store is closed")
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch {epoch!r}: expected a non-negative integer")
        data, digest, size = encode_shard(self.stream, self.rank, epoch, payload)
        path = self.path(self.local, epoch)
        self.local.write(self.stream, epoch, self.rank, data)
        self.ledger.remember(self.local.domain, epoch, digest, size)
        try:
            self.client.commit(self.stream, self.rank, self.local.domain, epoch, digest=digest,
                               size=size, location=shard_location(path))  # fmt: skip
        except ApiError as exc:
            if exc.reason != "retired":
                raise
            self._skip_retired(epoch, exc)
            return Shard(self.stream, self.rank, epoch, digest, size, payload, None,
                         self.local.domain, committed=False)  # fmt: skip
        with self._lock:
            self._collected.discard((self.local.domain, epoch))
        if self.remote is not None:
            self._uploads.put(epoch)
        return Shard(self.stream, self.rank, epoch, digest, size, payload, path, self.local.domain)

    def _skip_retired(self, epoch: int, refusal: ApiError) -> None:
        # Other ranks may hold the epoch's earlier content: a new one is not kept.
        with contextlib.suppress(OSError):
            self.local.delete(self.stream, epoch, self.rank)
        self.ledger.forget(self.local.domain, epoch)
        self.skipped.append(epoch)
        log.warning("epoch %d not saved, training goes on: %s", epoch, refusal)

    def _upload(self, epoch: int) -> None:
        remote = self.remote
        assert remote is not None
        with self._lock:
            if self._uploads.stopped or (remote.domain, epoch) in self._collected:
                return
            src = self.path(self.local, epoch)
            try:
                data = self.local.read(self.stream, epoch, self.rank)
            except FileNotFoundError:
                if (self.local.domain, epoch) in self._collected:
                    return  # collected before its upload: nothing needs it any more
                raise
            shard = decode_shard(data, path=src, stream=self.stream, rank=self.rank, epoch=epoch)
            # Complete or absent (StorageTier.write): a failure raises before the commit.
            remote.write(self.stream, epoch, self.rank, data)
            self.ledger.remember(remote.domain, epoch, shard.digest, shard.size)
            try:
                self.client.commit(
                    self.stream,
                    self.rank,
                    remote.domain,
                    epoch,
                    digest=shard.digest,
                    size=shard.size,
                    location=shard_location(self.path(remote, epoch)),
                )
            except ApiError as exc:
                if exc.reason != "retired":
                    raise
                with contextlib.suppress(OSError):  # retired there meanwhile: not wanted
                    remote.delete(self.stream, epoch, self.rank)
                self.ledger.forget(remote.domain, epoch)
                return
            self.uploaded.append(epoch)

    @property
    def pending_uploads(self) -> int:
        """Uploads saved but not yet finished."""
        return self._uploads.pending

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every upload queued so far has finished.

        Raises:
            TimeoutError: uploads are still pending after ``timeout`` seconds.
            UploadError: uploads failed since the last `flush` (each failure is
                reported once).
        """
        self._uploads.flush(timeout)

    def close(self, *, flush: bool = True, timeout: float | None = None) -> None:
        """Stop the uploader; with ``flush`` (the default), after the pending uploads.

        ``flush=False`` drops pending uploads at once, as a crash would; an upload whose
        commit waits for a restarting daemon is waited for: close the client first.

        Raises:
            UploadError, TimeoutError: as `flush`, when ``flush`` is true (the uploader
                is stopped either way).
        """
        if self._closed:
            return
        if self._hooked:
            self._hooked = False
            self.client.remove_reconnect_hook(self._reconnected)  # type: ignore[attr-defined]
        try:
            if flush:
                self.flush(timeout)
        finally:
            self._closed = True
            self._uploads.stop()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(flush=t is None)

    # -- restoring ----------------------------------------------------------------------

    def agreed_epoch(self, generation: int, timeout: float | None = None) -> int:
        """The restore point of recovery ``generation``, as the daemon answers it.

        Every member must ask (any rank of it): the answer comes once every member
        froze its recoverable set for the generation.

        Raises:
            NoRestorePointError: the generation has no restore point.
            RestorePointLostError: its restore point was retracted since.
            ApiError: kind ``timeout`` when not every member asked within ``timeout``;
                reason ``generation_closed`` when a newer generation is resolved.
        """
        answer = self.client.restore_point(self.stream, generation, timeout)
        if not answer.get("resolved", False):  # the daemon answers resolved or raises
            raise ApiError(
                ErrorKind.TIMEOUT,
                "timeout",
                f"generation {generation} unresolved, waiting for {answer.get('waiting_for')}",
            )
        epoch = answer.get("restore_point")
        if epoch is None:
            raise NoRestorePointError(self.stream, generation)
        if answer.get("lost"):
            raise RestorePointLostError(self.stream, generation, int(epoch))
        return int(epoch)

    def read(self, epoch: int, rank: int | None = None, *, retract: bool = True) -> Shard:
        """Read and verify the shard of ``epoch`` for ``rank`` (default: this store's).

        Tries the local tier, then the remote one. A copy that is missing or does not
        verify (header epoch, stream or rank, digest, size) is skipped and, with
        ``retract``, reported to the daemon as no longer readable in its domain.

        Raises:
            ShardUnavailableError: no tier holds a valid copy.
        """
        rank = self.rank if rank is None else rank
        reasons: list[str] = []
        for tier in self.tiers:
            try:
                return read_from(tier, self.stream, epoch, rank)
            except FileNotFoundError:
                reasons.append(f"{tier.domain}: missing")
            except CorruptShardError as exc:
                reasons.append(f"{tier.domain}: {exc.why}")
            if retract:
                self._retract(rank, tier.domain, epoch)
        raise ShardUnavailableError(self.stream, rank, epoch, reasons)

    def _retract(self, rank: int, domain: str, epoch: int) -> None:
        try:
            self.client.retract(self.stream, rank, domain, epoch)
        except ApiError as exc:
            if exc.kind is not ErrorKind.REJECTED:  # e.g. a rank another node hosts
                raise

    def next_generation(self, timeout: float | None = None) -> int:
        """A recovery generation no member has resolved, for a new launch: ask it on one
        rank and hand it to the others (`convergenced.integrations.launches`)."""
        return new_generation(self.client, self.stream, timeout)

    def restore(self, generation: int | None = None, timeout: float | None = None) -> Restored:
        """This rank's payload at the agreed restore point of recovery ``generation``.

        Returns exactly the agreed epoch or raises: a newer shard on disk, or an older
        intact one, is never returned instead. Every rank of a launch must pass the
        same generation, one no earlier launch resolved (`next_generation`); None: the
        generation of the launch the store declared its spec for, or, for a store
        opened with the stream's name, a new one, which only a stream of one rank may
        ask for.

        Raises:
            CheckpointError: ``generation`` is None and the stream has several ranks.
            NoRestorePointError: no epoch is restorable on every member (start fresh).
            RestorePointLostError: the agreed epoch was retracted since.
            ShardUnavailableError: neither tier holds a valid shard of it (the broken
                copies were retracted; ask again with a newer generation).
            ApiError: see `agreed_epoch`.
        """
        if generation is None and self.launch is not None:
            generation = self.launch.generation
        elif generation is None:
            generation = solo_generation(self.client, self.stream, timeout)
        epoch = self.agreed_epoch(generation, timeout)
        shard = self.read(epoch)
        if shard.epoch != epoch:  # read() verified it; keep the promise explicit
            raise CorruptShardError(shard.path, f"epoch {shard.epoch} is not {epoch}")
        return Restored(epoch, shard.payload)

    def restore_all(
        self, generation: int, ranks: Iterable[int], timeout: float | None = None
    ) -> tuple[int, dict[int, Payload]]:
        """The payloads of several ranks at the agreed restore point (tiers shared).

        Raises:
            MixedEpochError: the shards read are not all of the agreed epoch.
            and everything `restore` raises.
        """
        epoch = self.agreed_epoch(generation, timeout)
        shards = [self.read(epoch, rank) for rank in ranks]
        return epoch, load_consistent(shards, epoch=epoch)

    # -- garbage collection ---------------------------------------------------------------

    def gc(self) -> list[Deleted]:
        """Delete this rank's shards of the epochs the daemon says are safe to delete.

        For each tier and each epoch on disk in the state's ``safe_to_delete``, retire
        the (rank, domain, epoch) first, then delete the file: an epoch the daemon
        refuses to retire (it became protected meanwhile) is kept.

        Returns:
            What was deleted.
        """
        safe = self.client.state(self.stream).get("safe_to_delete") or []
        deleted: list[Deleted] = []
        if not safe:
            return deleted
        for tier in self.tiers:
            for epoch in self.epochs(tier):
                if not in_intervals(epoch, safe):
                    continue
                path = self.path(tier, epoch)
                with self._lock:
                    try:
                        self.client.retire(self.stream, self.rank, tier.domain, epoch)
                    except ApiError as exc:
                        if exc.reason == "not_safe_to_delete":
                            continue
                        raise
                    self._collected.add((tier.domain, epoch))
                    tier.delete(self.stream, epoch, self.rank)
                    self.ledger.forget(tier.domain, epoch)
                deleted.append(Deleted(tier.domain, epoch, path))
        return deleted
