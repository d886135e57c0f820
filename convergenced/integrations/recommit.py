"""Committing again the shards a rank still finds in its tiers.

A daemon whose state directory was lost restarts with an empty log: it knows nothing
of the shards on this node's disks until the ranks tell it. A `CheckpointStore`
therefore commits again, for each of its tiers, every shard of its rank it finds
there, after verifying it: when it opens, and after its client reconnected to a
daemon that restarted (`convergenced.client.Client.add_reconnect_hook`). To a daemon
that kept its log this costs one round trip per shard and changes nothing: a commit
it already holds, with the same digest, is acknowledged and adds no fact.

**What "verified" costs.** At open, every shard of this rank in every tier is read
once, whole: its header must name this stream, rank and epoch, and its size and
SHA-256 digest must match the payload (`convergenced.integrations.shards.read_shard`).
A shard that does not verify is not committed (`restore` would retract it). What was
verified (or found corrupt), and what this store wrote itself, is remembered with the
tier's stamp of it (a file's size, modification time and inode; an object's size and
ETag): after a reconnect only a shard whose stamp changed (or that is new) is read
again, so a reconnect costs a ``stat`` (a HEAD request) and a commit per shard, not a
read of the checkpoints.

**Retired epochs.** The daemon refuses a commit of an epoch this rank retired
(reason ``retired``): the daemon allowed its deletion and the retirement is durable,
so the file is only a leftover of a deletion cut short (a crash between ``retire`` and
``unlink``, or a retirement whose reply was lost in a restart). It is deleted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from convergenced.core.local_api_codec import ApiError
from convergenced.integrations.errors import CorruptShardError
from convergenced.integrations.store_api import StorageTier, read_from

__all__ = ["Ledger", "Recommitted"]

log = logging.getLogger("convergenced.integrations.files")

_Stamp = Hashable
"""A tier's stamp of a shard (`StorageTier.stamp`): changed when it is rewritten."""


@dataclass
class Recommitted:
    """What one pass of committing again did, per (domain, epoch)."""

    committed: list[tuple[str, int]] = field(default_factory=list)
    """Verified and acknowledged by the daemon."""
    read: list[tuple[str, int]] = field(default_factory=list)
    """Read whole to verify them (the others were known unchanged)."""
    corrupt: list[tuple[str, int]] = field(default_factory=list)
    """Did not verify: not committed."""
    deleted: list[tuple[str, int]] = field(default_factory=list)
    """Retired already (the daemon refused them): deleted."""


class Ledger:
    """The digests of one rank's shards that are known to verify, and the pass that
    commits them again (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        stream: str,
        rank: int,
        tier: Callable[[str], StorageTier],
        listing: Callable[[], Iterable[tuple[str, int]]],
    ) -> None:
        """``tier(domain)`` is the store's tier of a domain; ``listing()`` the (domain,
        epoch) of this rank's shards in every tier."""
        self.client = client
        self.stream = stream
        self.rank = rank
        self._tier = tier
        self._listing = listing
        self._lock = threading.Lock()  # never held across a request
        self._known: dict[tuple[str, int], tuple[_Stamp, str, int]] = {}
        self._corrupt: dict[tuple[str, int], _Stamp] = {}

    def remember(self, domain: str, epoch: int, digest: str, size: int) -> None:
        """The store wrote (or verified) this shard: no need to read it again."""
        stamp = self._tier(domain).stamp(self.stream, epoch, self.rank)
        if stamp is not None:
            with self._lock:
                self._known[(domain, epoch)] = (stamp, digest, size)

    def forget(self, domain: str, epoch: int) -> None:
        """The store deleted this shard."""
        with self._lock:
            self._known.pop((domain, epoch), None)
            self._corrupt.pop((domain, epoch), None)

    def recommit(self) -> Recommitted:
        """Verify (reading only what is new or changed) and commit again every shard
        of this rank in every tier; delete those the daemon says were retired.

        Raises:
            ApiError: the daemon refused a commit for another reason than
                ``retired`` (say the stream is not declared).
            DaemonUnreachable: the daemon cannot be reached.
        """
        done = Recommitted()
        for domain, epoch in self._listing():
            key = (domain, epoch)
            tier = self._tier(domain)
            stamp = tier.stamp(self.stream, epoch, self.rank)
            if stamp is None:
                continue  # deleted meanwhile
            with self._lock:
                known = self._known.get(key)
                if self._corrupt.get(key) == stamp:
                    continue  # did not verify, and was not rewritten since
            if known is not None and known[0] == stamp:
                digest, size = known[1], known[2]
            else:
                done.read.append(key)
                try:
                    shard = read_from(tier, self.stream, epoch, self.rank)
                except FileNotFoundError:
                    continue
                except CorruptShardError as exc:
                    log.warning("not committing %s again: %s", exc.path, exc.why)
                    done.corrupt.append(key)
                    self.forget(domain, epoch)
                    with self._lock:
                        self._corrupt[key] = stamp
                    continue
                digest, size = shard.digest, shard.size
                with self._lock:
                    self._known[key] = (stamp, digest, size)
            try:
                self.client.commit(self.stream, self.rank, domain, epoch, digest=digest, size=size)
            except ApiError as exc:
                if exc.reason != "retired":
                    raise
                tier.delete(self.stream, epoch, self.rank)
                self.forget(domain, epoch)
                done.deleted.append(key)
                continue
            done.committed.append(key)
        if done.committed or done.deleted or done.corrupt:
            log.info(
                "stream %r rank %d: committed %d shard(s) again (%d read to verify), "
                "%d corrupt, %d retired ones deleted",
                self.stream,
                self.rank,
                len(done.committed),
                len(done.read),
                len(done.corrupt),
                len(done.deleted),
            )
        return done
