"""One simulated daemon: the real core, admission and output gate over a virtual disk.

What a `SimNode` runs is what a daemon runs: a `NodeCore`, facts submitted through
the daemon's `Admission` (its limits and the retire rule), and every byte held back
by the `OutputGate` until the fsync that covers it. Only the disk is simulated:
`durable` is the write-ahead log, which survives a crash while everything else is
lost, and an fsync takes a while of virtual time, during which more facts join the
next group, as with the daemon's group commit. Every eighth write is a compaction
(the log rewritten from the core's compacted facts, as the daemon does when its log
grows), so replay of compacted logs is checked under every fault too.

The node also keeps what its disk holds in the oracle's terms (its highest durable
high-water mark and its durable frozen sets), for the gate's check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from convergenced.core.admission import Admission
from convergenced.core.facts import Fact, Freeze, HighWater, Incarnation
from convergenced.core.gate import GatedOutput, OutputGate
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import LinkConfig
from convergenced.core.node import NodeCore, NodeEvent
from convergenced.core.versions import Catalogue
from convergenced.core.wire import CREDENTIALS_VERSION
from convergenced.sim.trust import SimTrust

COMPACT_EVERY = 8
"""Every this many writes of a node's log is a compaction."""


@dataclass(frozen=True, slots=True)
class LogWrite:
    """One write of the log in flight: what it adds and the position it reaches."""

    life: int
    facts: list[Fact]
    upto: int
    snapshot: list[Fact] | None
    """For a compaction, the whole new log (the compacted facts); None: an append."""


@dataclass
class SimNode:
    """One node of the simulated cluster (see the module docstring)."""

    id: str
    lives: int = 0
    """Times this node's daemon started (a tick chain belongs to one life)."""
    core: NodeCore | None = None
    gate: OutputGate | None = None
    admission: Admission | None = None
    durable: list[Fact] = field(default_factory=list)
    """The write-ahead log: every fact an fsync completed for, over all lives."""
    key_incarnation: int = 0
    """The incarnation floor kept beside the identity key: it outlives the disk."""
    durable_high_water: int | None = None
    """The highest `HighWater` on the disk (it survives crashes, not a lost disk)."""
    ever_high_water: int | None = None
    """The highest `HighWater` this node ever made durable, over every disk it had."""
    durable_frozen: dict[int, IntervalSet] = field(default_factory=dict)
    """Every frozen set on the disk, by generation."""
    writing: LogWrite | None = None
    """The write in flight (one at a time, as the daemon's group commit)."""
    writes: int = 0
    crashes: int = 0
    paused_until: int = 0
    skew: float = 1.0
    backoff: dict[str, int] = field(default_factory=dict)
    polled_seq: int = -1
    catalogues: tuple[Catalogue, ...] = ()
    """The version catalogues of the node's configuration (`versions`)."""
    replies: list[tuple[int, Callable[[], None]]] = field(default_factory=list)
    """Answers to local reads waiting for the gate: (position, what the rank does
    with the answer)."""
    credentials: bool = False
    """CA-bound trust (`trust`): each life gossips credentials and checks records."""
    key: int = 0
    """Which identity key the node has: bumped when it is lost (with the floor)."""
    trust: SimTrust | None = None
    """This life's credential book and checks (with ``credentials``)."""
    refused: int = 0
    """Records this node refused for their signature, over all its lives."""

    @property
    def up(self) -> bool:
        """Whether the daemon is running."""
        return self.core is not None

    def boot(self, links: list[str], cluster: list[str]) -> list[NodeEvent]:
        """Start a life: a new core from the log, behind a new gate, as the daemon's
        start-up does (its incarnation above every one on the disk and the floor beside
        its key, and durable before anything else; a disk without one means a first
        start or a lost state).
        Returns (and drops) the events replay produced."""
        self.lives += 1
        past = [f.number for f in self.durable if isinstance(f, Incarnation)]
        incarnation = 1 + max([*past, self.key_incarnation])
        self.key_incarnation = incarnation
        trust = self.trust = None
        if self.credentials:
            trust = self.trust = SimTrust(self.id, self.key, incarnation, self._refused_one)
        core = NodeCore(
            self.id,
            incarnation,
            unsure_of_past=not past,
            catalogues=self.catalogues,
            sign=trust.sign if trust is not None else None,
            verify=trust.verify if trust is not None else None,
        )
        core.plan_links(links)
        core.replay(self.durable)
        self.durable.append(core.incarnation_fact())
        self.core = core
        self.gate = OutputGate(core)
        self.admission = Admission(core, self.gate, cluster=cluster)
        self.writing = None
        self.polled_seq = -1
        self.replies = []
        return list(iter(core.next_event, None))

    def _refused_one(self) -> None:
        self.refused += 1

    def link_config(self, base: LinkConfig) -> LinkConfig:
        """What this life's links run with: ``base``, and with CA-bound trust wire
        version 3 and this life's credential book."""
        if self.trust is None:
            return base
        return replace(base, wire_version=CREDENTIALS_VERSION, credentials=self.trust.book)

    def wipe_disk(self, *, floor_too: bool = False) -> None:
        """The state directory is gone: an empty log (the daemon must be down); with
        ``floor_too``, the incarnation floor beside the identity key as well, and with
        CA-bound trust the key itself (they share a directory): a new record key."""
        assert self.core is None
        if floor_too:
            self.key_incarnation = 0
            self.key += 1
        self.durable = []
        self.durable_high_water = None
        self.durable_frozen = {}

    def crash(self) -> None:
        """Lose everything but the disk (a write in flight never completes)."""
        self.crashes += 1
        self.core = self.gate = self.admission = None
        self.trust = None
        self.writing = None
        self.replies = []  # never answered

    def output(self) -> GatedOutput:
        """A new connection's output, held back by this life's gate."""
        assert self.gate is not None
        return self.gate.output()

    def reply(self, act: Callable[[], None]) -> None:
        """Answer a local read: the rank runs ``act`` once the answer may leave.

        The answer reveals the node's state now, so it waits for the gate like any
        other byte: at once when everything is durable, else after the write that
        covers it (and never, if the daemon crashes first).
        """
        assert self.gate is not None
        position = self.gate.position()
        if position <= self.gate.durable:
            act()
        else:
            self.replies.append((position, act))

    def released_replies(self) -> list[Callable[[], None]]:
        """The answers the last completed write let leave, in order."""
        if self.gate is None:
            return []
        durable = self.gate.durable
        ready = [act for position, act in self.replies if position <= durable]
        self.replies = [(p, act) for p, act in self.replies if p > durable]
        return ready

    # -- the virtual disk ----------------------------------------------------------

    def start_write(self) -> LogWrite | None:
        """Begin the next group write, if one is due and none is in flight."""
        gate, core = self.gate, self.core
        if gate is None or core is None or self.writing is not None or not gate.pending():
            return None
        facts, upto = gate.take_unlogged()
        self.writes += 1
        snapshot = None
        if self.writes % COMPACT_EVERY == 0:  # as the daemon compacts: incarnation first
            snapshot = [core.incarnation_fact(), *core.compacted_facts()]
        self.writing = LogWrite(self.lives, facts, upto, snapshot)
        return self.writing

    def finish_write(self, write: LogWrite) -> bool:
        """The fsync of ``write`` returned; False when the node crashed meanwhile."""
        if self.writing is not write or self.gate is None:
            return False
        self.writing = None
        if write.snapshot is not None:
            self.durable = list(write.snapshot)
        else:
            self.durable.extend(write.facts)
        for fact in write.facts:
            if isinstance(fact, HighWater):
                hw = self.durable_high_water
                self.durable_high_water = fact.epoch if hw is None else max(hw, fact.epoch)
                ever = self.ever_high_water
                self.ever_high_water = fact.epoch if ever is None else max(ever, fact.epoch)
            elif isinstance(fact, Freeze):
                self.durable_frozen.setdefault(fact.generation, fact.epochs)
        self.gate.synced(write.upto)
        return True

    def busy(self) -> bool:
        """Whether a fact is still on its way to the disk."""
        return self.writing is not None or (self.gate is not None and self.gate.pending())
