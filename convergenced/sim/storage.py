"""Where the job's checkpoint copies really are: node-local disks and a shared store.

Every copy a rank saves lives in one *place*. A domain the spec names shared (an
object store, a parallel file system) has one place for the whole cluster, `SHARED`,
readable from every node; any other domain (gpu, ram, nvme) is node-local: its
copies live on the disk of the node that wrote them, readable only there. A rank
that moves to another node therefore still reads its shared copies and none of its
node-local ones, and a node whose disk is lost (a replaced host, a state loss that
takes the local tiers too) loses the node-local copies stored on it.

Per (place, rank, domain) the storage keeps four sets of epochs: ``written`` there
(a rank saved it, whether or not its daemon acknowledged the commit: a save while the
daemon is down still leaves the file, which the rank commits again once the daemon is
back), ``ever`` acknowledged (some daemon made a commit of it durable: a claim, which
creates no copy), ``available`` there now (written, neither lost nor deleted) and
``retired`` (deleted by the job after its daemon said it was safe). The oracle judges
S1 with ``written`` minus ``retired``: a loss is outside anyone's control and
surfaces as a rollback (S3), a deletion is the protocol's doing, and a commit that
names a copy its rank cannot read where it runs (a rank that "adopts" a node-local
copy left on another host) creates nothing. What a rank finds when it looks is
``available``; what S5 expects, ``available`` and acknowledged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

SHARED = "(shared)"
"""The place of every copy in a shared domain (no node id looks like this)."""

Place = tuple[str, int, str]
"""(place, rank, domain): a node id or `SHARED`, the rank, the domain."""


def _sets() -> defaultdict[Place, set[int]]:
    return defaultdict(set)


class Storage:
    """The copies of one stream's checkpoints (see the module docstring)."""

    def __init__(self, shared: Iterable[str] = ()) -> None:
        self.shared = frozenset(shared)
        self.written = _sets()
        self.ever = _sets()
        self.available = _sets()
        self.retired = _sets()

    def place(self, node: str, rank: int, domain: str) -> Place:
        """Where a copy of ``rank`` in ``domain`` that ``node`` writes or reads is."""
        return (SHARED if domain in self.shared else node, rank, domain)

    def readable(self, node: str, rank: int, domain: str, epoch: int) -> bool:
        """S1's test of one copy: written where ``node`` reads it, and not deleted
        (losses do not count, see the module docstring)."""
        key = self.place(node, rank, domain)
        return epoch in self.written[key] and epoch not in self.retired[key]

    def found(self, node: str, rank: int, domain: str) -> set[int]:
        """The epochs of ``rank`` in ``domain`` that a rank on ``node`` finds now."""
        return self.available[self.place(node, rank, domain)]

    def committed(self, node: str, rank: int, domain: str) -> set[int]:
        """The epochs found there now that some daemon acknowledged (S5)."""
        key = self.place(node, rank, domain)
        return self.available[key] & self.ever[key]

    def saved(self, node: str, rank: int, domain: str, epoch: int) -> None:
        """A rank on ``node`` saved the copy (its commit is on its way, or refused)."""
        key = self.place(node, rank, domain)
        self.written[key].add(epoch)
        if epoch not in self.retired[key]:
            self.available[key].add(epoch)

    def acknowledged(self, node: str, rank: int, domain: str, epoch: int) -> None:
        """A commit of ``node`` is durable (it says the copy is where ``node`` reads it;
        only a save puts it there)."""
        self.ever[self.place(node, rank, domain)].add(epoch)

    def retire(self, node: str, rank: int, domain: str, epoch: int) -> None:
        """The job on ``node`` deleted the copy."""
        key = self.place(node, rank, domain)
        self.available[key].discard(epoch)
        self.retired[key].add(epoch)

    def lose(self, node: str, rank: int, domain: str, epoch: int) -> None:
        """The copy that ``node`` reads is lost (a retraction)."""
        self.available[self.place(node, rank, domain)].discard(epoch)

    def lose_disk(self, node: str) -> None:
        """``node``'s disk is gone: every node-local copy stored on it is lost."""
        for (where, _, _), epochs in self.available.items():
            if where == node:
                epochs.clear()

    def lose_all(self, node: str, ranks: Iterable[int], domains: Iterable[str]) -> None:
        """Every copy of ``ranks`` that ``node`` reads is lost, shared ones too (a job
        that ends and takes its checkpoints with it)."""
        for rank in ranks:
            for d in domains:
                self.available[self.place(node, rank, d)].clear()

    def newest(self) -> int:
        """The newest epoch written anywhere (0: none)."""
        return max((max(s) for s in self.written.values() if s), default=0)
