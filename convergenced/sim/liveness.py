"""The liveness phase (S5): faults stop, and every member must converge in time.

When the faulty phase ends, the network heals, paused and skewed daemons run
normally, crashed ones restart (not those gone for good) and every link between
running nodes reconnects. Once every such link is up, every member of the job holds
its spec (a relaunch that moved ranks has declared its member map), and no fact is on
its way to a disk, every rank commits one final epoch in every domain of the policy,
on the node that hosts it. From the last acknowledgement of those commits the truth
no longer changes, so the target is fixed: the newest epoch of the true convergence
interval of the job's members at or above the retention floor. The run converges
when every member reports it, and fails S5 if that takes more than `liveness_bound`
handshake rounds, or never happens before the run's time limit. Nodes the job left
keep whatever spec they held and are not waited for.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Protocol

from convergenced.core.facts import Commit, Fact
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Network
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import InvariantViolation, Truth
from convergenced.sim.placement import Placement
from convergenced.sim.versions import SimVersions
from convergenced.sim.workload import DomainModel

QUIET_POLL_US = 1_000
"""How often the liveness phase looks whether the healed cluster is quiet."""


def liveness_bound(nodes: int) -> int:
    """S5's bound on handshake rounds from the last commit to agreement after healing.

    Two phases each cross the overlay's diameter (at most ceil(log2 N) hops), so
    ``2 * ceil(log2 N)``; the slack of 8 covers what a healed cluster still carries
    from the faulty phase (a token parked mid-exchange, a link's nudge already
    spent). Fault-free runs are held to the tight bound by the tests.
    """
    return 2 * max(1, math.ceil(math.log2(max(nodes, 2)))) + 8


class LivenessWorld(Protocol):
    """What the liveness phase acts on: the world of one run."""

    loop: EventLoop
    net: Network
    nodes: dict[str, SimNode]
    ids: list[str]
    pairs: list[tuple[str, str]]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    domains: list[DomainModel]
    phase: str
    deferred: int
    latency_us: int
    gone: set[str]
    versions: SimVersions

    def restart(self, nid: str) -> None:
        """Start ``nid``'s daemon again from its log."""

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A rank of ``nid`` submits ``fact`` to its daemon."""


class Liveness:
    """The liveness phase of one run (see the module docstring)."""

    def __init__(self, world: LivenessWorld) -> None:
        self.world = world
        self.final_epoch: int | None = None
        self.final_acks = 0
        self._final_needed = 0
        self.t_final: int | None = None
        """When the last final commit was acknowledged (None: not yet)."""
        self.want: int | None = None
        """The restore point every node must reach (fixed at ``t_final``)."""
        self.bytes_at_final = 0
        self.rounds: int | None = None
        """Handshake rounds it took, once converged."""
        self._waiting: tuple[tuple[str, ...], int] = ((), 0)
        """The members `converged` asked about last, and the first of them not there."""

    def begin(self) -> None:
        """The faults stop: heal the network, restart every daemon, reconnect."""
        w = self.world
        w.phase = "liveness"
        w.loop.trace("liveness phase")
        w.net.heal()
        for nid in w.ids:
            node = w.nodes[nid]
            node.paused_until = 0
            node.skew = 1.0
            if not node.up:
                w.restart(nid)
        for a, b in self._pairs():
            w.loop.after(0, w.net.connect, a, b)
        w.loop.after(QUIET_POLL_US, self._await_mesh)

    def _pairs(self) -> list[tuple[str, str]]:
        gone = self.world.gone
        return [(a, b) for a, b in self.world.pairs if a not in gone and b not in gone]

    def _quiet(self) -> bool:
        """Every link between running nodes up, every member of the job holding its
        spec, no fact on its way to a disk."""
        w = self.world
        up = all(
            (c := w.net.get(a, b)) is not None and c.established_at is not None
            for a, b in self._pairs()
        )
        spec = w.spec
        declared = w.placement.same_as(spec.members) and all(
            (core := w.nodes[m].core) is not None
            and STREAM in core.streams()
            and core.spec(STREAM) == spec
            for m in spec.member_ids
        )
        busy = w.deferred or any(n.busy() for n in w.nodes.values())
        return up and declared and not busy

    def _await_mesh(self) -> None:
        w = self.world
        if not self._quiet():
            w.loop.after(QUIET_POLL_US, self._await_mesh)
            return
        self.final_epoch = w.truth.storage.newest() + 1
        self._final_needed = sum(len(r) for _, r in w.spec.members) * len(w.domains)
        w.loop.trace(f"final commit {self.final_epoch}")
        for nid in w.spec.member_ids:
            for rank in w.spec.ranks_of(nid):
                for d in w.domains:
                    w.truth.storage.saved(nid, rank, d.name, self.final_epoch)
                    fact = Commit(STREAM, rank, d.name, self.final_epoch)
                    w.loop.after(1, w.submit, nid, fact)

    def acknowledged(self, epoch: int) -> bool:
        """A commit of ``epoch`` was acknowledged; True when it was the last final
        one (the target is fixed from then on)."""
        if epoch != self.final_epoch:
            return False
        self.final_acks += 1
        if self.final_acks != self._final_needed:
            return False
        w = self.world
        self.t_final = w.loop.now
        self.bytes_at_final = w.net.bytes
        self.want = self.expected_restore_point()
        return True

    def expected_restore_point(self) -> int | None:
        """S5: the newest epoch of the true convergence interval at or above the floor."""
        w = self.world
        ci = w.truth.convergence(w.spec)
        members = w.spec.member_ids
        hws = [h for h in (w.nodes[m].ever_high_water for m in members) if h is not None]
        floor = max(hws) - w.spec.retention if hws else 0
        return ci.at_least(max(floor, 0)).max()

    def converged(self) -> bool:
        """Whether every node reports the target now (then ``rounds`` says how many
        handshake rounds it took; `check_bound` holds them to S5's bound)."""
        w = self.world
        if self.t_final is None:
            return False
        want, nodes = self.want, w.nodes

        def there(nid: str) -> bool:
            core = nodes[nid].core
            return core is not None and core.restore_point(STREAM) == want

        # Asked after every move of a restore point: start with the member that was
        # not there last time (O(1) while it still is not), and say yes only once every
        # member is there now.
        members = w.spec.member_ids
        if self._waiting[0] is not members:
            self._waiting = (members, 0)
        start = self._waiting[1]
        for i in chain(range(start, len(members)), range(start)):
            if not there(members[i]):
                self._waiting = (members, i)
                return False
        if not w.versions.converged():
            return False
        rtt = 2 * w.latency_us
        self.rounds = max(1, math.ceil((w.loop.now - self.t_final) / rtt))
        return True

    def check_bound(self) -> None:
        """S5: converging took at most `liveness_bound` handshake rounds."""
        bound = liveness_bound(len(self.world.ids))
        if self.rounds is not None and self.rounds > bound:
            raise InvariantViolation(
                "S5", f"converged after {self.rounds} handshake rounds, bound {bound}"
            )

    def failure(self) -> InvariantViolation:
        """The violation of a run that never converged."""
        w = self.world
        want = self.expected_restore_point()
        got = {
            nid: (n.core.restore_point(STREAM) if n.core and STREAM in n.core.streams() else "-")
            for nid, n in w.nodes.items()
            if nid in w.spec.member_ids
        }
        if self.final_epoch is None:  # the target was never fixed: say why, not None
            return InvariantViolation(
                "S5",
                f"the healed cluster never got quiet for the final commit (the job runs on "
                f"{w.placement.node_ids()}, its last declared map names {list(w.spec.member_ids)}"
                f"): {got}",
            )
        if all(point == want for point in got.values()):
            return w.versions.failure()  # the job agreed; its version handshake did not
        return InvariantViolation("S5", f"no convergence on {want} after healing: {got}")
