"""The simulated job: what the ranks do with their daemon between relaunches.

Ranks save each epoch into every domain (`workload`) on the node that hosts them now
(`placement`), ask their daemon what they may delete and delete it once the gated
answer arrives, and, after a node lost its state directory, commit again the epochs
they still find there (as the files integration does after verifying each shard):
their node-local copies on that node's disk and their shared copies (`storage`).
Every deletion is checked against ground truth (S4) at the moment it happens.
Relaunches, with the same member map or a new one, are `launches`.
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.facts import Commit, Fact, Retire
from convergenced.core.interval_set import IntervalSet
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.placement import Placement
from convergenced.sim.storage import SHARED
from convergenced.sim.workload import DomainModel, RankSchedule


class JobWorld(Protocol):
    """What the job acts on: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    domains: list[DomainModel]
    phase: str
    closed_below: dict[str, int]

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A rank of ``nid`` submits ``fact`` to its daemon."""


class Job:
    """The ranks of every node (see the module docstring)."""

    def __init__(self, world: JobWorld, *, period_us: int, until_us: int) -> None:
        self.world = world
        self.period_us = period_us
        self.until_us = until_us
        """Saves stop at this virtual time (the end of the faulty phase)."""
        self.moving: set[int] = set()
        """Ranks a relaunch moved that have not started on their new node yet: they
        save nothing before their ranks declared the job's spec there and adopted what
        they found (then the answer of the relaunch's generation can only name what
        they really read there)."""

    def start(self, nodes: list[str]) -> None:
        """Schedule the saves of every rank and the deletion rounds of ``nodes`` (the
        spares' too: a rank that moves there deletes there)."""
        w = self.world
        for rank in sorted(w.placement.hosts):
            self._next_save(RankSchedule(rank, self.period_us, w.domains, w.loop.rng))
        for nid in nodes:
            w.loop.at(w.loop.rng.randint(20_000, 40_000), self._retire_round, nid)

    # -- saving -------------------------------------------------------------------

    def _next_save(self, sched: RankSchedule) -> None:
        loop = self.world.loop
        epoch, times = sched.next_epoch()
        for domain, t in times.items():
            if t < self.until_us:
                loop.at(t, self._save, sched.rank, domain, epoch)
        first = min(times.values())
        if first < self.until_us:
            loop.at(first, self._schedule_more, sched, epoch)

    def _schedule_more(self, sched: RankSchedule, epoch: int) -> None:
        if sched.epoch == epoch:
            self._next_save(sched)

    def _save(self, rank: int, domain: str, epoch: int) -> None:
        """The save lands, on the node that hosts the rank now, and is committed."""
        w = self.world
        if w.phase == "safety" and rank not in self.moving:
            host = w.placement.hosts[rank]
            w.truth.storage.saved(host, rank, domain, epoch)
            w.submit(host, Commit(STREAM, rank, domain, epoch))

    def moved(self, ranks: set[int]) -> None:
        """A relaunch moved ``ranks`` to other nodes: they stop until they start there."""
        self.moving |= ranks

    def started(self, nid: str, spec: StreamSpec) -> None:
        """``spec`` is declared on ``nid``: the ranks the job runs there start."""
        hosts = self.world.placement.hosts
        self.moving -= {r for r in spec.ranks_of(nid) if hosts.get(r) == nid}

    def recommit(self, nid: str, ranks: list[int] | None = None) -> None:
        """``ranks`` (default: every rank ``nid`` hosts) commit on ``nid`` what they
        find readable there: after their daemon restarted (a no-op for what it holds;
        what it lost, or never acknowledged, it takes), or on arriving (adoption)."""
        w = self.world
        found = w.truth.storage.found
        for rank in w.placement.ranks_on(nid) if ranks is None else ranks:
            for d in w.domains:
                for e in sorted(found(nid, rank, d.name)):
                    w.submit(nid, Commit(STREAM, rank, d.name, e))

    # -- deleting -------------------------------------------------------------------

    def _retire_round(self, nid: str) -> None:
        """The ranks ask what they may delete, and delete it once the answer arrives."""
        w = self.world
        if w.phase != "safety":
            return
        loop = w.loop
        loop.after(loop.rng.randint(20_000, 60_000), self._retire_round, nid)
        node = w.nodes[nid]
        core = node.core
        if core is None or node.paused_until > loop.now or STREAM not in core.streams():
            return
        spec = w.spec
        # The job's ranks on this node, once they declared the job's spec: a launch
        # that moved ranks deletes nothing before its ranks declared where they run.
        if core.spec(STREAM) != spec or not w.placement.same_as(spec.members):
            return
        safe = core.safe_to_delete(STREAM)
        if safe:
            node.reply(lambda: self._delete(nid, safe, spec))

    def _delete(self, nid: str, safe: IntervalSet, spec: StreamSpec) -> None:
        """The ranks of ``nid`` delete what the daemon said is safe, then retire it."""
        w = self.world
        if w.phase != "safety" or w.spec is not spec:
            return  # relaunched with another member map meanwhile: those ranks died
        high_water = {m: w.nodes[m].ever_high_water for m in spec.member_ids}
        # Only the deleting node's own open sets: a generation's answer lies in every
        # member's frozen set, so an epoch outside ours can never be one (S4, 17).
        frozen = {nid: self.open_frozen(nid)}
        truth, loop = w.truth, w.loop
        storage = truth.storage
        shared_newest = truth.shared_newest(spec)
        for rank in spec.ranks_of(nid):
            for d in w.domains:
                place = storage.place(nid, rank, d.name)
                doomed = sorted(e for e in storage.available[place] if e in safe)
                newest = shared_newest if place[0] == SHARED else None
                for e in doomed:
                    truth.check_retire(nid, e, spec, high_water, frozen, shared_newest=newest)
                    storage.retire(nid, rank, d.name, e)
                    truth.touch()
                    loop.trace(f"retire {nid} r{rank} {d.name} {e}")
                    w.submit(nid, Retire(STREAM, rank, d.name, e))

    def open_frozen(self, nid: str) -> list[IntervalSet]:
        """Frozen sets on ``nid``'s disk of generations no newer resolved one closed."""
        closed = self.world.closed_below.get(nid, 0)
        return [s for g, s in self.world.nodes[nid].durable_frozen.items() if g >= closed]
