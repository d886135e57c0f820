"""Local facts and the recoverable set they imply.

A *fact* is something a rank or the daemon itself told us and that the daemon made
durable before acting on it: a declaration, a commit, a retraction, a retirement, a
frozen set for a recovery generation, or the restore-point high-water mark. The
daemon writes facts to its write-ahead log and replays them on start; the core only
ever sees facts that are already durable, so nothing it publishes can be forgotten
by a crash.

From the facts of one stream, `StreamFacts` computes the node's *recoverable set*
E(n): the epochs for which every rank hosted here satisfies the stream's policy.
Availability per (rank, domain) is tracked as an interval set that commits add to
and retractions and retirements remove from. A retired epoch is gone for good: a
commit for it is refused, because the daemon already told someone it could be
deleted.

Beside each held epoch, the digest, size and location it was committed with (its
`Content`) are kept while it is held, so a commit sent again can be told from a
different checkpoint of the same epoch (`commits`), and the verifier knows what to
read; log compaction keeps them too. Sizes are summed per domain as they come and
go, so what the ranks store (`StreamFacts.stored`) costs nothing to read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from convergenced.core.errors import FactError
from convergenced.core.generations import Generations
from convergenced.core.interval_set import EMPTY, MAX_EPOCH, IntervalSet
from convergenced.core.spec import PolicyMode, StreamSpec
from convergenced.core.validate import NAME_RE

# Re-exported: they are facts like the others (`Fact`), kept in a module of their own.
from convergenced.core.version_facts import ComponentReport as ComponentReport  # noqa: PLC0414
from convergenced.core.version_facts import RolloutNote as RolloutNote  # noqa: PLC0414


@dataclass(frozen=True, slots=True)
class Declare:
    """A job declared (or re-declared, identically) a stream on this node."""

    spec: StreamSpec


@dataclass(frozen=True, slots=True)
class Undeclare:
    """The job removed ``stream`` from this node: its facts are forgotten (PROTOCOL.md 7.4)."""

    stream: str


@dataclass(frozen=True, slots=True)
class Commit:
    """Rank ``rank`` made ``epoch`` durable in ``domain``."""

    stream: str
    rank: int
    domain: str
    epoch: int
    digest: str = ""
    """Content digest the rank computed (opaque to the core; kept in the log)."""
    size: int = 0
    """Bytes written (opaque to the core; kept in the log)."""
    location: str = ""
    """Where the bytes are (`locations.Location.to_text`; opaque, kept in the log)."""


@dataclass(frozen=True, slots=True)
class Content:
    """What a commit said about the bytes of the epoch it made durable.

    Kept per held (rank, domain, epoch) when the commit stated a digest or a size;
    an epoch held without one has none (`StreamFacts.content`).
    """

    digest: str
    size: int
    after: int | None
    """The newest recovery generation this node had frozen when the commit was
    applied (None: none). Derived from the order of the log, so a replay gives the
    same; `commits` compares it with the generations frozen since."""
    location: str = ""
    """Where the commit said the bytes are ("": it did not say)."""

    def same(self, digest: str, size: int) -> bool:
        """Whether a commit stating ``digest`` and ``size`` says the same bytes."""
        return self.digest == digest and self.size == size


@dataclass(frozen=True, slots=True)
class Stored:
    """What this node's ranks of a stream hold in one domain: the epochs committed
    there and neither retracted nor retired (`StreamFacts.stored`)."""

    bytes: int
    """The sum of the sizes their commits stated (none stated: 0), over ranks and epochs."""
    epochs: int
    """How many epochs at least one of the ranks holds there."""


@dataclass(frozen=True, slots=True)
class Retract:
    """``epoch`` is no longer readable in ``domain`` for ``rank`` (lost, corrupt)."""

    stream: str
    rank: int
    domain: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Retire:
    """Rank ``rank`` deleted ``epoch`` from ``domain`` after the daemon said it was safe."""

    stream: str
    rank: int
    domain: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Freeze:
    """This node's frozen recoverable set for recovery generation ``generation``."""

    stream: str
    generation: int
    epochs: IntervalSet


@dataclass(frozen=True, slots=True)
class HighWater:
    """The highest restore point this node has ever published for ``stream``.

    Produced by the core itself; it must be durable before the record that carries
    the restore point leaves the node, because other nodes garbage-collect below it.

    ``evidence`` holds, per other member, the (incarnation, version) of its record
    that justified this restore point. After a restart, records older than that are
    stale (a relay can bring them back) and must not pass for a loss: they are
    ignored until fresher ones arrive, so a restart never fakes a rollback (S3).
    An entry for the node itself marks a mark adopted from its own record of a life
    it does not remember (`lives`, rule 3).

    ``membership`` is the stream's membership (`StreamSpec.membership`) whose restore
    point reached ``epoch``: after a restart, the highest mark of the current
    membership stands in for the restore point, never one the job reached with
    another member map, which the new world may not be able to read. The node's
    mark is the highest of all (what its record publishes and the rollback floor
    uses). None: a mark of no current membership (log compaction writes the overall
    mark so when it belongs to an older one).
    """

    stream: str
    epoch: int
    evidence: tuple[tuple[str, int, int], ...] = ()
    membership: int | None = 0


@dataclass(frozen=True, slots=True)
class Horizon:
    """The highest GC horizon this node computed for ``stream``.

    Produced by the core when its horizon rises, durable before anything that could
    reveal it leaves (as `HighWater`). Nothing at or above it was ever declared safe
    to delete here, so a frozen set may keep every recoverable epoch from it on
    (`generations`, rule 1); without it the node falls back to its high-water mark
    minus the retention, which bounds every horizon but keeps fewer epochs, such as
    the shared-tier copies a membership change needs.
    """

    stream: str
    epoch: int


@dataclass(frozen=True, slots=True)
class CloseGenerations:
    """Generations below ``below`` are closed: a newer one resolved.

    Produced by the core. Losing it in a crash is safe (the old generations only
    protect more epochs for a while), but persisting it keeps a late request for a
    closed generation from waiting forever on frozen sets peers already dropped.
    """

    stream: str
    below: int


@dataclass(frozen=True, slots=True)
class RankState:
    """All that one rank committed, lost and retired in one domain, in compacted form.

    Written only by log compaction, in place of the commits, retractions and
    retirements it sums up; applying it sets the rank's sets to exactly these and
    forgets the digests and sizes held for them. Compaction writes, after it, one
    `Commit` per held epoch that has a `Content`, which brings them back.
    """

    stream: str
    rank: int
    domain: str
    available: IntervalSet
    retired: IntervalSet


@dataclass(frozen=True, slots=True)
class Incarnation:
    """This node's ``number``-th life: logged at every start (before anything of it
    can leave), and by the core when it learns of a life of its own it does not
    remember (its state was lost), above that one.

    Records are ordered per origin by (incarnation, version), so a node's stamps
    never go backwards as long as every incarnation it ever used is above the last.

    ``unsure``: the life is unsure of its past (it started without a log, or from
    the log of such a life before it learned its past of every stream): a replay
    starts unsure again, and a stream is known only after its `Settled` (`lives`).
    """

    number: int
    unsure: bool = False


@dataclass(frozen=True, slots=True)
class Settled:
    """This node, unsure of its past, heard from every member of ``stream`` it links
    to and adopted what they told of its earlier lives (`lives`, rule 2): after a
    restart from the log it knows its past of the stream and does not wait again.
    Produced by the core; losing it only makes the node wait again after a crash."""

    stream: str
    taken_below: int = 0
    """Generations below it may be resolved somewhere (the members' records showed
    them, `lives` rule 4): a relaunch is numbered above them."""


Fact = (
    Declare
    | Undeclare
    | Commit
    | Retract
    | Retire
    | Freeze
    | HighWater
    | Horizon
    | CloseGenerations
    | RankState
    | Incarnation
    | Settled
    | ComponentReport
    | RolloutNote
)
EpochFact = Commit | Retract | Retire


@dataclass(slots=True)
class StreamFacts:
    """All local facts of one stream on one node, and what follows from them."""

    spec: StreamSpec
    node: str
    available: dict[tuple[int, str], IntervalSet] = field(default_factory=dict)
    retired: dict[tuple[int, str], IntervalSet] = field(default_factory=dict)
    generations: Generations = field(init=False)
    """Recovery generations: frozen sets, closure, answers (see `generations`)."""
    high_water: int | None = None
    """The highest restore point this node ever published (any membership)."""
    membership_high_water: int | None = None
    """The highest restore point it published under the current membership (not
    adopted): what stands in for the restore point after a restart."""
    horizon: int | None = None
    """The highest GC horizon this node computed (`Horizon`); None: unknown."""
    evidence: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per other member, the newest (incarnation, version) a high-water mark rested on
    (merged over every `HighWater`; log compaction writes it back as one). An entry
    for this node itself means the mark was adopted from a life it does not remember
    (`lives`, rule 3): it bounds the rollback floor but never stands in for a
    restore point after a restart."""
    contents: dict[tuple[int, str], dict[int, Content]] = field(default_factory=dict)
    """Per (rank, domain), the `Content` of each held epoch whose commit stated one."""
    _stored_bytes: dict[str, int] = field(default_factory=dict)
    """Per domain, the sum of the sizes in `contents`: kept as they change (`_held`,
    `_drop_contents`), so `stored` never walks the epochs."""
    _rank_sets: dict[int, IntervalSet] = field(default_factory=dict)
    _recoverable: IntervalSet = field(default_factory=IntervalSet)
    _ranks: tuple[int, ...] = ()
    _newest: dict[str, int] = field(default_factory=dict)
    _newest_in_policy: dict[str, int] | None = None
    """`newest_by_domain`, kept until `_newest` or the spec changes (None: not yet)."""
    _scans: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    """Resume points of `_every_rank_holds`: key -> (epoch, first rank index not
    yet seen holding it)."""

    def __post_init__(self) -> None:
        self.generations = Generations(self.spec.name, membership=self.spec.membership)
        self._ranks = self.spec.ranks_of(self.node)
        self._recompute_all()

    def rehost(self, spec: StreamSpec) -> tuple[int, ...]:
        """Move to ``spec``, a new membership of this stream (`StreamSpec.same_stream`).

        The ranks this node still hosts keep their facts; the ranks it no longer
        hosts are forgotten here (their node-local copies are not readable where
        they now run, and their shared copies are committed there, see
        `integrations.recommit`); new ranks start with nothing. The restore point of
        the new membership starts over. Returns the ranks forgotten.
        """
        assert spec.same_stream(self.spec) and spec.membership > self.spec.membership
        gone = tuple(r for r in self._ranks if r not in spec.ranks_of(self.node))
        for key in [k for k in self.contents if k[0] in gone]:
            self._drop_contents(key)
        for table in (self.available, self.retired):
            for key in [k for k in table if k[0] in gone]:
                del table[key]
        for r in gone:
            self._rank_sets.pop(r, None)
        self.spec = spec
        self.generations.membership = spec.membership
        self.membership_high_water = None
        self._ranks = spec.ranks_of(self.node)
        self._newest.clear()
        self._newest_in_policy = None
        self._recompute_all()
        return gone

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks this node hosts in the stream."""
        return self._ranks

    @property
    def high_water_adopted(self) -> bool:
        """Whether the high-water mark came from a life this node does not remember."""
        return self.node in self.evidence

    @property
    def recoverable(self) -> IntervalSet:
        """E(n): epochs every local rank can restore under the policy."""
        return self._recoverable

    # -- validation and application ----------------------------------------

    def check_rank(self, rank: int, domain: str) -> None:
        """Raise `FactError` unless ``rank`` is ours and ``domain`` a valid name."""
        if rank not in self.ranks:
            raise FactError(
                f"stream {self.spec.name!r}: rank {rank} is not hosted by {self.node}",
                reason="unknown_rank",
            )
        if not isinstance(domain, str) or not NAME_RE.match(domain):
            raise FactError(f"domain {domain!r} is not a valid name", reason="bad_domain")

    def check(self, fact: EpochFact) -> None:
        """Raise `FactError` if ``fact`` cannot be applied; never changes anything."""
        self.check_rank(fact.rank, fact.domain)
        if type(fact.epoch) is not int or not 0 <= fact.epoch <= MAX_EPOCH:
            raise FactError(f"epoch {fact.epoch!r} is not in [0, 2^63-1]", reason="bad_epoch")
        key = (fact.rank, fact.domain)
        if isinstance(fact, Commit) and fact.epoch in self.retired.get(key, EMPTY):
            raise FactError(
                f"stream {self.spec.name!r}: epoch {fact.epoch} was retired from "
                f"{fact.domain} by rank {fact.rank}; commit a new epoch instead",
                reason="retired",
            )

    def content(self, rank: int, domain: str, epoch: int) -> Content | None:
        """The `Content` of a held epoch (None: not held, or held without one)."""
        held = self.contents.get((rank, domain))
        return held.get(epoch) if held else None

    def holds(self, rank: int, domain: str, epoch: int) -> bool:
        """Whether ``rank`` holds ``epoch`` in ``domain`` (committed, not lost or retired)."""
        return epoch in self.available.get((rank, domain), EMPTY)

    def apply(self, fact: EpochFact) -> bool:
        """Check and apply a fact; return True when the recoverable set or newest changed.

        A commit of an epoch already held replaces its `Content` (the log holds the
        commits admitted, in order: the last one stands); `commits` decides which
        may be admitted.

        Raises:
            FactError: refused (`check`); nothing changed.
        """
        self.check(fact)
        return self.apply_checked(fact)

    def apply_checked(self, fact: EpochFact) -> bool:
        """`apply` a fact that `check` just accepted against this state (the caller
        checked it: `NodeCore`), without checking it again."""
        key = (fact.rank, fact.domain)
        self._set_content(key, fact)
        before = self.available.get(key, EMPTY)
        if isinstance(fact, Commit):
            after = before.add(fact.epoch)
        else:
            after = before.remove(fact.epoch)
            if isinstance(fact, Retire):
                self.retired[key] = self.retired.get(key, EMPTY).add(fact.epoch)
        if after is before:
            return False
        self.available[key] = after
        if isinstance(fact, Commit):
            self._commit_added(fact.rank, fact.domain, fact.epoch)
            return True
        self._forget_scans()
        self._recompute_newest(fact.domain)
        if fact.domain in self.spec.policy.domains:
            self._recompute_rank(fact.rank)
        return True

    def _set_content(self, key: tuple[int, str], fact: EpochFact) -> None:
        held = self.contents.get(key)
        old = held.get(fact.epoch) if held else None
        if old is not None:
            self._held(key[1], -old.size)
        if isinstance(fact, Commit) and (fact.digest or fact.size or fact.location):
            if held is None:
                held = self.contents[key] = {}
            held[fact.epoch] = Content(
                fact.digest, fact.size, self.generations.newest_frozen(), fact.location
            )
            self._held(key[1], fact.size)
        elif held is not None:
            held.pop(fact.epoch, None)  # lost, retired, or committed again without one
            if not held:
                del self.contents[key]

    def _drop_contents(self, key: tuple[int, str]) -> None:
        """Forget every `Content` of ``key`` (its sets are being replaced or dropped)."""
        held = self.contents.pop(key, None)
        if held:
            self._held(key[1], -sum(c.size for c in held.values()))

    def _held(self, domain: str, change: int) -> None:
        total = self._stored_bytes.get(domain, 0) + change
        if total:
            self._stored_bytes[domain] = total
        else:
            self._stored_bytes.pop(domain, None)

    def _commit_added(self, rank: int, domain: str, epoch: int) -> None:
        # A commit only adds one epoch, so every derived set can only gain that epoch:
        # membership tests instead of recomputing intersections (the hot path of a
        # daemon taking thousands of commits a second). Retractions, retirements and
        # compacted states take the full recomputation.
        holds = self.available.get
        if epoch > self._newest.get(domain, -1) and self._every_rank_holds(
            ("newest", domain), epoch, lambda r: holds((r, domain), EMPTY)
        ):
            self._newest[domain] = epoch
            self._newest = dict(sorted(self._newest.items()))
            self._newest_in_policy = None
        policy = self.spec.policy
        if domain not in policy.domains:
            return
        old = self._rank_sets.get(rank, EMPTY)
        if epoch in old:
            return
        if policy.mode is PolicyMode.ALL and not all(
            epoch in holds((rank, d), EMPTY) for d in policy.domains
        ):
            return
        self._rank_sets[rank] = old.add(epoch)
        rank_sets = self._rank_sets.get
        if self._every_rank_holds(("recoverable", ""), epoch, lambda r: rank_sets(r, EMPTY)):
            self._recoverable = self._recoverable.add(epoch)

    def _every_rank_holds(
        self, key: tuple[str, str], epoch: int, set_of: Callable[[int], IntervalSet]
    ) -> bool:
        """Whether ``set_of(r)`` holds ``epoch`` for every rank r.

        Ranks commit an epoch one after another, so the scan resumes where the last
        scan of the same key and epoch stopped: O(1) amortized per commit instead of
        O(ranks). Sound because these sets only grow between two scans; anything
        that shrinks them clears the resume points (`_forget_scans`).
        """
        ranks = self._ranks
        start = 0
        resume = self._scans.get(key)
        if resume is not None and resume[0] == epoch:
            start = resume[1]
        for i in range(start, len(ranks)):
            if epoch not in set_of(ranks[i]):
                self._scans[key] = (epoch, i)
                return False
        self._scans.pop(key, None)
        return True

    def _forget_scans(self) -> None:
        self._scans.clear()

    def restore_rank(self, state: RankState) -> None:
        """Apply a compacted `RankState` (checked first)."""
        self.check_rank(state.rank, state.domain)
        key = (state.rank, state.domain)
        self._drop_contents(key)  # the commits compaction writes after it restore them
        for table, value in ((self.available, state.available), (self.retired, state.retired)):
            if value:
                table[key] = value
            else:
                table.pop(key, None)
        self._forget_scans()
        self._recompute_newest(state.domain)
        if state.domain in self.spec.policy.domains:
            self._recompute_rank(state.rank)

    def compacted(self) -> list[RankState]:
        """One `RankState` per (rank, domain) with anything to remember."""
        keys = sorted(set(self.available) | set(self.retired))
        return [
            RankState(
                self.spec.name,
                rank,
                domain,
                self.available.get((rank, domain), EMPTY),
                self.retired.get((rank, domain), EMPTY),
            )
            for rank, domain in keys
            if self.available.get((rank, domain)) or self.retired.get((rank, domain))
        ]

    def content_commits(self) -> list[tuple[int | None, Commit]]:
        """The `Commit` that restores each held `Content` after its `RankState`, with
        the newest generation frozen when it was first applied (compaction writes
        each before the frozen sets of later generations, so a replay gives the
        same), sorted."""
        out: list[tuple[int | None, Commit]] = []
        name = self.spec.name
        for (rank, domain), held in sorted(self.contents.items()):
            for epoch, c in sorted(held.items()):
                out.append(
                    (c.after, Commit(name, rank, domain, epoch, c.digest, c.size, c.location))
                )
        return out

    # -- derived state -------------------------------------------------------

    def newest_by_domain(self) -> dict[str, int]:
        """Per domain of the policy, the newest epoch that every local rank holds there.

        What the record publishes and ``state`` shows. Only the policy's domains, so it
        never holds more than `limits.MAX_POLICY_DOMAINS` entries: the local API refuses
        commits elsewhere, but a log written before it did may still hold some.
        """
        cached = self._newest_in_policy
        if cached is None:
            domains = self.spec.policy.domains
            cached = {d: e for d, e in self._newest.items() if d in domains}
            self._newest_in_policy = cached
        return dict(cached)  # the caller's to keep

    def stored(self) -> dict[str, Stored]:
        """Per domain of the policy (sorted), what this node's ranks hold there.

        Read at every ``state`` and metrics scrape, so bounded whatever the history:
        the bytes are kept summed as facts apply, and the epochs are counted on the
        union of the ranks' interval sets, O(ranks hosted here x their ranges) per
        domain, at most `limits.MAX_POLICY_DOMAINS` domains. Only the policy's domains,
        as `newest_by_domain`, so labels stay bounded by the spec.
        """
        out: dict[str, Stored] = {}
        for d in sorted(self.spec.policy.domains):
            held = IntervalSet.union_all([self.available.get((r, d), EMPTY) for r in self._ranks])
            out[d] = Stored(self._stored_bytes.get(d, 0), len(held))
        return out

    def _recompute_newest(self, domain: str) -> None:
        common = IntervalSet.intersect_all(
            [self.available.get((r, domain), EMPTY) for r in self._ranks]
        )
        newest = common.max()
        if newest is None:
            self._newest.pop(domain, None)
        else:
            self._newest[domain] = newest
        self._newest = dict(sorted(self._newest.items()))
        self._newest_in_policy = None

    def _rank_set(self, rank: int) -> IntervalSet:
        sets = [self.available.get((rank, d), EMPTY) for d in self.spec.policy.domains]
        if self.spec.policy.mode is PolicyMode.ALL:
            return IntervalSet.intersect_all(sets)
        return IntervalSet.union_all(sets)

    def _recompute_rank(self, rank: int) -> None:
        new = self._rank_set(rank)
        if new == self._rank_sets.get(rank):
            return  # e.g. a fast tier ahead of the policy's slow one: nothing changes
        self._rank_sets[rank] = new
        self._recoverable = IntervalSet.intersect_all([self._rank_sets[r] for r in self._ranks])

    def _recompute_all(self) -> None:
        self._forget_scans()
        for r in self._ranks:
            self._rank_sets[r] = self._rank_set(r)
        self._recoverable = IntervalSet.intersect_all([self._rank_sets[r] for r in self._ranks])
        for d in sorted({d for _, d in self.available}):
            self._recompute_newest(d)
