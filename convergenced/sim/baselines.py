"""What other checkpoint tools would have restored (``--compare``).

Every 5 ms of virtual time during the faulty phase, at every crash and at every
membership change, the simulator asks what each baseline's restore rule would make
every rank load if the job restarted now, on the nodes its ranks run on now, and
scores the picks:

* *mixed*: the ranks would load different epochs (or some would find nothing and
  start over while others load an epoch): the model and optimizer state would be
  silently inconsistent;
* *unreadable*: they agree on one epoch, but some rank cannot read it, on the node
  it now runs on, in the policy's domains: the test S1 applies to convergenced's
  answers (a node-local copy written on that node or a shared copy, not deleted;
  losses count against neither);
* a sample where no rank finds anything is not counted.

At the same instants every node's convergenced restore point gets S1's test under
the member map that node holds.

Both baselines keep their pointer where their checkpoints live: in the shared tier
when the policy names a shared domain, else on each node's node-local disk, lost
with that disk (a replaced host, a state loss that takes the local tiers).

* ``marker`` (DeepSpeed, Megatron): a rank's save of an epoch is complete once it
  reached every policy domain; rank 0 then writes ``latest`` = that epoch. In the
  shared tier there is one marker, pointing to whatever was last written; on
  node-local storage (DeepSpeed's ``use_node_local_storage``) each node's local rank 0
  writes its own, and the ranks of a node read that node's marker.
* ``torchtitan``: a save writes a ``step-N`` directory, and rank 0 writes its
  ``.metadata`` once every rank's save of N is complete (DCP's finish, after every
  rank wrote); each rank loads the highest step directory holding ``.metadata`` by
  its own listing of the checkpoint folder: the shared one, or the folder on its
  own node, where ``.metadata`` exists only if rank 0 ran there when it wrote it.
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.placement import Placement

SAMPLE_US = 5_000
"""Virtual time between two samples."""
BASELINES = ("marker", "torchtitan")


class BaselineWorld(Protocol):
    """What the baselines look at: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    phase: str


class Baselines:
    """The pointers each baseline keeps, the samples and their scores (see the
    module docstring)."""

    def __init__(self, world: BaselineWorld, enabled: frozenset[str]) -> None:
        self.world = world
        self.enabled = [b for b in BASELINES if b in enabled]
        self.counts: dict[str, int] = {}
        """``<baseline>_samples``, ``_mixed``, ``_unreadable``; ``convergence_*``."""
        spec = world.spec
        self._in_shared = bool(spec.shared)
        """Whether the checkpoints (and so the pointers) live in the shared tier."""
        self._domains = len(spec.policy.domains)
        self._ranks = sum(len(r) for _, r in spec.members)
        self._reached: dict[tuple[int, int], set[str]] = {}
        """(rank, epoch) -> the domains its save reached so far."""
        self._complete: dict[int, int] = {}
        """Rank -> its newest complete save."""
        self._done: dict[int, set[int]] = {}
        """Epoch -> the ranks whose save of it is complete (until every rank's is)."""
        self.marker: dict[str, int] = {}
        """Where the ``latest`` marker is (a node, or ``""`` for the shared tier) -> it."""
        self.metadata: dict[str, set[int]] = {}
        """Where the ``.metadata`` files are -> the steps that have one."""
        self._spec_for: tuple[Placement, StreamSpec] | None = None

    def start(self) -> None:
        """Schedule the first sample."""
        self.world.loop.at(SAMPLE_US, self.sample)

    # -- what the tools write ------------------------------------------------------

    def acknowledged(self, nid: str, rank: int, domain: str, epoch: int) -> None:
        """``rank``'s copy of ``epoch`` in ``domain`` is durable on ``nid``."""
        if epoch <= self._complete.get(rank, 0):
            return  # a commit again of an older save, not a new save completing
        reached = self._reached.setdefault((rank, epoch), set())
        reached.add(domain)
        if len(reached) < self._domains:
            return
        for e in [e for (r, e) in self._reached if r == rank and e <= epoch]:
            del self._reached[(rank, e)]
        self._complete[rank] = epoch
        w = self.world
        if rank == min(w.placement.ranks_on(nid), default=None):  # (local) rank 0
            if not self._in_shared:
                self.marker[nid] = epoch
            elif rank == 0:
                self.marker[""] = epoch
        done = self._done.setdefault(epoch, set())
        done.add(rank)
        if len(done) == self._ranks:  # the save is complete: rank 0 writes .metadata
            del self._done[epoch]
            where = "" if self._in_shared else w.placement.hosts[0]
            self.metadata.setdefault(where, set()).add(epoch)

    def lost_disk(self, nid: str) -> None:
        """``nid``'s disk is gone, with the pointers on it."""
        self.marker.pop(nid, None)
        self.metadata.pop(nid, None)

    # -- sampling ------------------------------------------------------------------

    def sample(self, reschedule: bool = True) -> None:
        """Score each rule now (and, with ``reschedule``, sample again later)."""
        w = self.world
        if w.phase != "safety":
            return
        if reschedule:
            w.loop.after(SAMPLE_US, self.sample)
        spec = self._placement_spec()
        for name in self.enabled:
            picks = {self._pick(name, where) for where in self._where()}
            if picks == {None}:
                continue  # nothing anywhere: every rank starts over, consistently
            self._count(f"{name}_samples")
            if len(picks) > 1:
                self._count(f"{name}_mixed")
                continue
            (only,) = picks
            if only is not None and not w.truth.valid(only, spec):
                self._count(f"{name}_unreadable")
        for nid in w.ids:
            node = w.nodes[nid]
            core = node.core
            # As S1 judges them: what a node can report (nothing on its way to disk),
            # under the member map it holds, unless the job left it since.
            if core is None or STREAM not in core.streams() or node.busy():
                continue
            held = core.spec(STREAM)
            if w.truth.superseded(held, nid):
                continue
            rp = core.restore_point(STREAM)
            self._count("convergence_samples")
            if rp is not None and not w.truth.valid(rp, held):
                self._count("convergence_invalid")

    def _where(self) -> list[str]:
        """Where each rank looks for its pointer (one entry per place looked in)."""
        if self._in_shared:
            return [""]
        return self.world.placement.node_ids()

    def _pick(self, name: str, where: str) -> int | None:
        if name == "marker":
            return self.marker.get(where)
        steps = self.metadata.get(where)
        return max(steps) if steps else None

    def _placement_spec(self) -> StreamSpec:
        """A spec of the ranks where they run now (the job's, unless a relaunch that
        moved them has not declared yet)."""
        w = self.world
        if w.placement.same_as(w.spec.members):
            return w.spec
        if self._spec_for is None or self._spec_for[0] is not w.placement:
            s = w.spec
            spec = StreamSpec.create(s.name, w.placement.members(), s.policy, s.retention,
                                     shared=s.shared)  # fmt: skip
            self._spec_for = (w.placement, spec)
        return self._spec_for[1]

    def _count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1
