"""Relaunches of the simulated job, with the same member map or a new one.

A relaunch (a preemption, a requeue, a rerun, or a membership change: a spare for a
dead host, fewer or more nodes) follows what the integrations do and the protocol
asks (PROTOCOL.md section 8.1):

1. One rank of the new launch, on a member drawn at random (rank 0 need not run
   where it ran before, and may run on a spare that holds no stream yet), asks its
   daemon ``next_generation`` and hands the number g to the others (a broadcast).
   The launcher's own counter is back at 0: the job keeps no count of its own.
2. Every member's ranks declare the job's spec: the same one, or, when the ranks
   moved since the last declaration, a new membership of it (the new member map,
   ``membership = g``). A rank that arrived on a node *adopts* its checkpoints: it
   commits there every copy it finds readable from that node (its shared copies,
   and node-local ones on that node's disk), as the integrations re-commit the
   verified shards they find when they open.
3. Every member's ranks ask for the restore point of generation g.

The ranks of the launch before die with it: those that had not asked yet never do,
and one whose request was already on its way may still reach its daemon (half the
time), declaring its own launch's spec and asking its own generation.

A launch fails, and its launcher starts the job again, when its rank 0 gets no number:
its daemon answers nothing for `OPEN_TRIES` tries, or dies before the answer leaves
(the answer waits for the write that covers it, and a crash takes it: the rank's
connection breaks, as `new_generation` raises). Without the second, a crash between
the question and the answer left the job without a launch for good (sim seed 300293:
the crash at the end of the faulty phase took the answer of the launch that was to
declare the new member map on a member whose ranks of the launch before had died).
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.errors import FactError
from convergenced.core.facts import Fact
from convergenced.core.node import NodeCore
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.placement import Placement

RETRY_US = 20_000
"""A rank whose daemon cannot take its request now asks again this much later."""
OPEN_TRIES = 10
"""Rank 0 asks for a generation this many times (every `RETRY_US`) before the launch
times out and the launcher starts the job again (rank 0 may then run elsewhere): a
daemon that lost its state answers nothing until it heard from every member, and one
of them may have died for good."""
SUPERSEDED = frozenset({"spec_conflict", "membership_superseded"})
"""The refusals of a declaration that end a launch (the job starts again)."""


class LaunchWorld(Protocol):
    """What a launch acts on: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    resolved: dict[bytes, int]

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A rank of ``nid`` submits ``fact``; the reason when the daemon refused it."""

    def declare(self, nid: str, spec: StreamSpec) -> str | None:
        """The ranks of ``nid`` declare ``spec`` unless their daemon holds it, and the
        ranks new there adopt what they find; the reason when the daemon refused it."""

    def declared(self, spec: StreamSpec) -> None:
        """The job's spec is ``spec`` from now on (a new membership of the stream)."""


class Launches:
    """The job's launches (see the module docstring)."""

    def __init__(self, world: LaunchWorld) -> None:
        self.world = world
        self.launch = 0
        """Launches so far: the simulator's own bookkeeping, never shown to a daemon."""
        self.generation_of: dict[int, int] = {}
        """The generation each launch handed out, once it did."""
        self._conflicted = False
        """A launch's declaration was refused: the next one declares a new membership
        even on the same member map (under a new number, above the one refused)."""
        self._asking: tuple[str, int] | None = None
        """(node, launch): the rank 0 waiting for its daemon's answer to
        ``next_generation``, while it waits."""

    def relaunch(self) -> int:
        """Relaunch the job on its current placement; returns the launch's number."""
        self.launch += 1
        w = self.world
        loop = w.loop
        opener = loop.rng.choice(w.placement.node_ids())
        loop.after(loop.rng.randint(0, 10_000), self._open, opener, self.launch, OPEN_TRIES)
        return self.launch

    def _core(self, nid: str) -> NodeCore | None:
        """``nid``'s core, if it can take a rank's request now."""
        node = self.world.nodes[nid]
        if node.core is None or node.paused_until > self.world.loop.now:
            return None
        return node.core

    def _open(self, nid: str, launch: int, tries: int) -> None:
        w = self.world
        if launch != self.launch:
            return  # relaunched again before this launch's rank 0 asked
        core = self._core(nid)
        generation = None
        if core is not None:
            try:
                generation = core.next_generation(STREAM)
            except FactError as exc:  # e.g. not declared here, on a core that needs it
                w.loop.trace(f"open refused {nid} {exc.reason}")
        if generation is None:
            if tries > 1:
                w.loop.after(RETRY_US, self._open, nid, launch, tries - 1)  # ask again later
            else:
                w.loop.trace(f"launch {launch} timed out at {nid}")
                self.relaunch()
            return
        w.loop.trace(f"open {nid} g{generation}")
        self._asking = (nid, launch)
        w.nodes[nid].reply(lambda: self._hand_out(nid, launch, generation))

    def daemon_died(self, nid: str) -> None:
        """``nid``'s daemon died: if the live launch's rank 0 was waiting for its
        answer, the launch fails and the launcher starts the job again."""
        if self._asking != (nid, self.launch):
            return
        self._asking = None
        self.world.loop.trace(f"launch {self.launch} failed: {nid} died before answering")
        self.relaunch()

    def _hand_out(self, opener: str, launch: int, generation: int) -> None:
        """Rank 0 got the number: the launch's ranks learn it (a broadcast), declare
        the job's spec (a new membership when the ranks moved) and ask for it."""
        if self._asking == (opener, launch):
            self._asking = None
        if launch != self.launch:
            return  # the launch died before it handed the number out
        w = self.world
        spec = w.spec
        if self._conflicted or not w.placement.same_as(spec.members):
            self._conflicted = False
            spec = StreamSpec.create(
                spec.name, w.placement.members(), spec.policy, spec.retention,
                shared=spec.shared, membership=generation,
            )  # fmt: skip
            w.loop.trace(f"membership g{generation} {sorted(w.placement.members().items())}")
            w.declared(spec)
        w.truth.check_opened(opener, generation, w.resolved.get(spec.digest, -1))
        self.generation_of[launch] = generation
        loop = w.loop
        for nid in spec.member_ids:
            loop.after(loop.rng.randint(0, 30_000), self._join, nid, generation, launch, spec)

    def _join(self, nid: str, generation: int, launch: int, spec: StreamSpec) -> None:
        """The ranks of ``nid`` declare ``spec`` if their daemon holds another one
        (adopting what they find), then ask for ``generation``."""
        w = self.world
        if launch != self.launch and w.loop.rng.random() < 0.5:
            return  # its launch died: the rank never asked, or its request was lost
        core = self._core(nid)
        if core is None:
            w.loop.after(RETRY_US, self._join, nid, generation, launch, spec)
            return
        refused = w.declare(nid, spec)
        if refused in SUPERSEDED:
            # A newer membership, or another map under the same number: two launches
            # got one generation before either had heard of the other's. The live
            # launch fails and its launcher starts the job again; a dead one is gone.
            if launch == self.launch:
                w.loop.trace(f"launch {launch} failed: {refused} at {nid}")
                self._conflicted = True
                self.relaunch()
            return
        if refused is not None:
            w.loop.after(RETRY_US, self._join, nid, generation, launch, spec)
            return
        self._freeze(nid, generation, launch)

    def _freeze(self, nid: str, generation: int, launch: int) -> None:
        w = self.world
        core = self._core(nid)
        if core is None or STREAM not in core.streams() or core.waiting_to_freeze(STREAM):
            w.loop.after(RETRY_US, self._retry_freeze, nid, generation, launch)
            return
        try:
            fact = core.freeze_fact(STREAM, generation)
        except FactError as exc:
            w.loop.trace(f"freeze refused {nid} g{generation} {exc.reason}")
            return
        if fact is not None:
            w.loop.trace(f"freeze {nid} g{generation} {fact.epochs}")
            w.submit(nid, fact)

    def _retry_freeze(self, nid: str, generation: int, launch: int) -> None:
        if launch != self.launch and self.world.loop.rng.random() < 0.5:
            return  # its launch died meanwhile
        self._freeze(nid, generation, launch)
