"""The simulated job: what the ranks on each node do with their daemon.

Ranks save each epoch into every domain (`workload`), ask their daemon what they may
delete and delete it once the gated answer arrives, and, after a node lost its state
directory, commit again the epochs they still find on their disks (as the files
integration does after verifying each shard). When the job is relaunched, one rank asks
its daemon for a new recovery generation and hands it to the others, as the torch
integration does, and every member's ranks ask for its restore point. Every deletion
is checked against ground truth (S4) at the moment it happens.
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.errors import FactError
from convergenced.core.facts import Commit, Fact, Retire
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.workload import DomainModel, RankSchedule

RETRY_US = 20_000


class JobWorld(Protocol):
    """What the job acts on: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    truth: Truth
    domains: list[DomainModel]
    phase: str
    closed_below: dict[str, int]
    resolved_anywhere: int

    def submit(self, nid: str, fact: Fact) -> None:
        """A rank of ``nid`` submits ``fact`` to its daemon."""


class Job:
    """The ranks of every node (see the module docstring)."""

    def __init__(self, world: JobWorld, *, period_us: int, until_us: int) -> None:
        self.world = world
        self.period_us = period_us
        self.until_us = until_us
        """Saves stop at this virtual time (the end of the faulty phase)."""
        self.launch = 0
        """Launches so far: the simulator's own bookkeeping, never shown to a daemon."""

    def start(self, nid: str) -> None:
        """Schedule the saves and deletion rounds of ``nid``'s ranks."""
        w = self.world
        for rank in w.spec.ranks_of(nid):
            self._next_save(nid, RankSchedule(rank, self.period_us, w.domains, w.loop.rng))
        w.loop.at(w.loop.rng.randint(20_000, 40_000), self._retire_round, nid)

    # -- saving -------------------------------------------------------------------

    def _next_save(self, nid: str, sched: RankSchedule) -> None:
        loop = self.world.loop
        epoch, times = sched.next_epoch()
        for domain, t in times.items():
            if t < self.until_us:
                loop.at(t, self._save, nid, sched.rank, domain, epoch)
        first = min(times.values())
        if first < self.until_us:
            loop.at(first, self._schedule_more, nid, sched, epoch)

    def _schedule_more(self, nid: str, sched: RankSchedule, epoch: int) -> None:
        if sched.epoch == epoch:
            self._next_save(nid, sched)

    def _save(self, nid: str, rank: int, domain: str, epoch: int) -> None:
        if self.world.phase == "safety":
            self.world.submit(nid, Commit(STREAM, rank, domain, epoch))

    def recommit(self, nid: str) -> None:
        """``nid`` lost its state: its ranks commit what they still hold."""
        w = self.world
        for rank in w.spec.ranks_of(nid):
            for d in w.domains:
                for e in sorted(w.truth.available[(rank, d.name)]):
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
        safe = core.safe_to_delete(STREAM)
        if safe:
            node.reply(lambda: self._delete(nid, safe))

    def _delete(self, nid: str, safe: IntervalSet) -> None:
        """The ranks of ``nid`` delete what the daemon said is safe, then retire it."""
        w = self.world
        if w.phase != "safety":
            return
        high_water = {m: w.nodes[m].ever_high_water for m in w.ids}
        # Only the deleting node's own open sets: a generation's answer lies in every
        # member's frozen set, so an epoch outside ours can never be one (S4, 17).
        frozen = {nid: self.open_frozen(nid)}
        truth, loop = w.truth, w.loop
        for rank in w.spec.ranks_of(nid):
            for d in w.domains:
                key = (rank, d.name)
                doomed = sorted(e for e in truth.available[key] if e in safe)
                for e in doomed:
                    truth.check_retire(nid, e, high_water, frozen)
                    truth.available[key].discard(e)
                    truth.retired[key].add(e)
                    truth.touch()
                    loop.trace(f"retire {nid} r{rank} {d.name} {e}")
                    w.submit(nid, Retire(STREAM, rank, d.name, e))

    def open_frozen(self, nid: str) -> list[IntervalSet]:
        """Frozen sets on ``nid``'s disk of generations no newer resolved one closed."""
        closed = self.world.closed_below.get(nid, 0)
        return [s for g, s in self.world.nodes[nid].durable_frozen.items() if g >= closed]

    # -- recovery generations -----------------------------------------------------------

    def recovery(self) -> None:
        """The job is relaunched, its launcher's counter back at 0 (the job keeps no
        count of its own): one rank, on a member drawn at random (rank 0 need not run
        where it ran before), asks its daemon for a new generation and hands it to
        every rank, and each member's ranks ask their daemon for it. The ranks of the
        launch before die with it: those that had not asked yet never do, and one
        whose request was already on its way may still reach its daemon."""
        self.launch += 1
        loop = self.world.loop
        opener = loop.rng.choice(self.world.ids)
        loop.after(loop.rng.randint(0, 10_000), self._open, opener, self.launch)

    def _ready(self, nid: str) -> NodeCore | None:
        """``nid``'s core, if it can take a rank's request now."""
        node = self.world.nodes[nid]
        core = node.core
        if core is None or node.paused_until > self.world.loop.now:
            return None
        if STREAM not in core.streams() or core.waiting_to_freeze(STREAM):
            return None
        return core

    def _open(self, nid: str, launch: int) -> None:
        w = self.world
        if launch != self.launch:
            return  # relaunched again before this launch's rank 0 asked
        core = self._ready(nid)
        generation = core.next_generation(STREAM) if core is not None else None
        if generation is None:
            w.loop.after(RETRY_US, self._open, nid, launch)  # ask again later
            return
        w.loop.trace(f"open {nid} g{generation}")
        w.truth.check_opened(nid, generation, w.resolved_anywhere)
        w.nodes[nid].reply(lambda: self._hand_out(launch, generation))

    def _hand_out(self, launch: int, generation: int) -> None:
        """Rank 0 got the number: the launch's ranks learn it (a broadcast) and ask."""
        if launch != self.launch:
            return  # the launch died before it handed the number out
        loop = self.world.loop
        for nid in self.world.ids:
            loop.after(loop.rng.randint(0, 30_000), self._freeze, nid, generation, launch)

    def _freeze(self, nid: str, generation: int, launch: int) -> None:
        w = self.world
        if launch != self.launch and w.loop.rng.random() < 0.5:
            return  # its launch died: the rank never asked, or its request was lost
        core = self._ready(nid)
        if core is None:
            w.loop.after(RETRY_US, self._freeze, nid, generation, launch)  # ask again later
            return
        try:
            fact = core.freeze_fact(STREAM, generation)
        except FactError as exc:
            w.loop.trace(f"freeze refused {nid} g{generation} {exc.reason}")
            return
        if fact is not None:
            w.loop.trace(f"freeze {nid} g{generation} {fact.epochs}")
            w.submit(nid, fact)
