"""The life and death of the simulated daemons, and of the job's member maps.

A daemon crashes (kill -9: what its log did not make durable is gone) and restarts
from its log at a higher incarnation; it may lose its state directory (and, with it,
the node-local checkpoints on that disk); its job may undeclare the stream and a job
of the same name declare it again; a host may die for good. At every restart the
job's ranks declare again and commit again every copy they find, as the integrations
do when they reconnect. A relaunch of the job, with the same member map or a new one,
is `launches`; the faults that call for one are `faults`.

`DaemonLives` is `world.Simulation`'s part of this (a mixin: it works on the world's
state).
"""

from __future__ import annotations

from collections.abc import Callable

from convergenced.core.facts import Declare, Fact, Undeclare
from convergenced.core.local_api_codec import ApiError
from convergenced.core.spec import StreamSpec
from convergenced.sim.baselines import Baselines
from convergenced.sim.config import SimConfig
from convergenced.sim.job import Job
from convergenced.sim.launches import Launches
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Network
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.placement import Placement
from convergenced.sim.versions import SimVersions
from convergenced.sim.workload import DomainModel


class DaemonLives:
    """`Simulation`'s daemons' lives (see the module docstring)."""

    cfg: SimConfig
    loop: EventLoop
    net: Network
    nodes: dict[str, SimNode]
    ids: list[str]
    peers: dict[str, list[str]]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    domains: list[DomainModel]
    job: Job
    launches: Launches
    baselines: Baselines
    phase: str
    gone: set[str]
    amnesiac: set[str]
    undeclared: dict[str, bool]
    undeclares: dict[str, int]
    closed_below: dict[str, int]
    versions: SimVersions
    submit: Callable[[str, Fact], str | None]  # Simulation's
    after_change: Callable[[str], None]
    _write: Callable[[str], None]
    _tick: Callable[[str, int], None]

    def crash(self, nid: str, *, state_lost: bool = False) -> None:
        """``nid``'s daemon dies: what its log did not make durable is gone."""
        node = self.nodes[nid]
        node.crash()
        self.truth.crashed(nid, node.durable_high_water, state_lost=state_lost)
        self.loop.trace(f"fault crash {nid}")
        if self.cfg.compare:
            self.baselines.sample(reschedule=False)
        self.net.node_down(nid, self.peers[nid])
        self.launches.daemon_died(nid)  # an answer it had not sent yet is lost

    def lose_state(self, nid: str, *, floor_too: bool = False, local_too: bool = False) -> None:
        """``nid``'s daemon dies and its state directory is lost (its identity key and
        its checkpoints survive; the incarnation floor too unless ``floor_too``; its
        node-local checkpoints too unless ``local_too``); it comes back later, from an
        empty log."""
        self.crash(nid, state_lost=True)
        self.nodes[nid].wipe_disk(floor_too=floor_too)
        if local_too:
            self._lose_disk(nid)
        self.amnesiac.add(nid)
        self.truth.retractions += 1  # a loss: the restore point may move back (S3)
        extra = (" and floor" if floor_too else "") + (" and local tiers" if local_too else "")
        self.loop.trace(f"fault lose_state {nid}{extra}")

    def _lose_disk(self, nid: str) -> None:
        self.truth.storage.lose_disk(nid)
        self.truth.touch()
        if self.cfg.compare:
            self.baselines.lost_disk(nid)

    def would_forget_everything(self, nid: str) -> bool:
        """Whether losing ``nid``'s state now would leave no member that remembers the
        stream's past: every other one lost its state too and has not heard from the
        others since. Nothing can be recovered then (PROTOCOL.md 13.9), so the
        ``lose_state`` fault never does that."""
        for n in list(self.amnesiac):
            core = self.nodes[n].core
            if core is not None and STREAM in core.streams() and not core.waiting_to_freeze(STREAM):
                self.amnesiac.discard(n)  # it heard from the others: it knows again
        return not set(self.spec.member_ids) - self.amnesiac - {nid}

    def undeclare(self, nid: str, *, keep_checkpoints: bool) -> None:
        """The job on ``nid`` ends and undeclares the stream; a job of the same name
        declares it again later, with its checkpoints or with none."""
        node = self.nodes[nid]
        core = node.core
        if node.admission is None or node.paused_until > self.loop.now or core is None:
            return
        if STREAM not in core.streams() or nid in self.undeclared:
            return
        try:
            node.admission.submit(Undeclare(STREAM))
        except ApiError as err:  # not settled yet after a lost state
            self.loop.trace(f"refused {nid} Undeclare {err.reason}")
            return
        self.loop.trace(f"fault undeclare {nid}{' keeping' if keep_checkpoints else ''}")
        self.truth.retractions += 1  # the others roll back: its checkpoints may go (S3)
        self.truth.last_rp.pop(nid, None)  # a new stream of the same name follows
        self.undeclares[nid] = self.undeclares.get(nid, 0) + 1
        self.closed_below[nid] = max(self.closed_below.get(nid, 0),
                                     core.generations_closed_below(STREAM))  # fmt: skip
        if not keep_checkpoints:
            names = [d.name for d in self.domains]
            self.truth.storage.lose_all(nid, self.placement.ranks_on(nid), names)
        self.undeclared[nid] = True
        self.after_change(nid)
        self.loop.after(self.loop.rng.randint(5_000, 100_000), self._redeclare, nid, node.lives)

    def _redeclare(self, nid: str, life: int) -> None:
        node = self.nodes[nid]
        if node.lives != life or not node.up or not self.undeclared.pop(nid, False):
            return  # down, or restarted meanwhile: `restart` declares it again
        self.declare(nid, self.spec, adopt=self.phase == "safety")

    def declare(self, nid: str, spec: StreamSpec, *, adopt: bool = True) -> str | None:
        """The job's ranks on ``nid`` declare ``spec`` unless the daemon holds it (a
        node the spec leaves out declares nothing); the ranks that are new to the node
        there (all of them, on a node that held no spec) commit what they find, with
        ``adopt``. Returns the reason when the daemon refused it (``down``: none runs)."""
        core = self.nodes[nid].core
        if core is None:
            return "down"
        held = core.spec(STREAM) if STREAM in core.streams() else None
        if nid not in spec.member_ids:
            return None
        if held != spec:
            refused = self.submit(nid, Declare(spec))
            if refused is not None:
                return refused
            self.versions.report(nid)
            before = held.ranks_of(nid) if held is not None else ()
            arrived = [r for r in spec.ranks_of(nid) if r not in before]
            if adopt and arrived:
                self.job.recommit(nid, arrived)
        self.job.started(nid, spec)
        return None

    def restart(self, nid: str) -> None:
        """``nid``'s daemon starts again, from its log, at the next incarnation."""
        node = self.nodes[nid]
        if node.up or nid in self.gone:
            return
        node.boot(self.configured_peers(nid), self.ids)
        node.paused_until = 0
        loop = self.loop
        core = node.core
        assert core is not None
        loop.trace(f"restart {nid} inc {core.incarnation}")
        self._write(nid)  # replay may have produced facts of the core's own
        # The job's ranks declare again when they reconnect (after a lost state, or a
        # new membership whose declaration the crash took before its fsync), and
        # commit again every copy they find, as the integrations' reconnect hook does:
        # repeats for a daemon that kept its log, the lost or never acknowledged ones
        # for the others (only while faults strike: S5's target is fixed after).
        self.undeclared.pop(nid, None)
        self.declare(nid, self.spec, adopt=False)
        self.versions.report(nid)  # its hook reports again (a repeat if its log kept it)
        if self.phase == "safety":
            self.job.recommit(nid)
        loop.after(loop.rng.randint(0, self.cfg.tick_us), self._tick, nid, node.lives)
        for peer in self.peers[nid]:
            a, b = (nid, peer) if nid < peer else (peer, nid)
            loop.after(loop.rng.randint(0, 5_000), self.net.connect, a, b)

    # -- relaunches and membership changes ------------------------------------------

    def recovery(self) -> None:
        """The job is relaunched on the nodes it runs on (`launches`)."""
        self.launches.relaunch()

    def declared(self, spec: StreamSpec) -> None:
        """A relaunch declares ``spec``, a new membership of the stream."""
        self.spec = spec
        self.truth.declared(spec)
        self.truth.retractions += 1  # restore points restart under it: rollbacks (S3)

    def adopt(self, nid: str, ranks: list[int]) -> None:
        """``ranks``, new on ``nid``, commit there what they find readable."""
        self.job.recommit(nid, ranks)

    def gone_for_good(self, nid: str) -> None:
        """``nid``'s host dies and never comes back; its disk is lost with it."""
        if self.nodes[nid].up:
            self.crash(nid)
        self.gone.add(nid)
        self._lose_disk(nid)
        self.truth.retractions += 1  # a loss: the restore point may move back (S3)
        self.loop.trace(f"fault gone {nid}")
        # The operator takes the dead host out of the others' configuration and
        # reloads them (docs/operations.md): a node that lost its state, or a spare,
        # waits to hear from every peer it is configured to link to, so one that never
        # heard from the dead host would wait for it forever (13.9, rule 2).
        for other in self.ids:
            core = self.nodes[other].core
            if core is not None:
                core.plan_links(self.configured_peers(other))
                self.after_change(other)

    def configured_peers(self, nid: str) -> list[str]:
        """The peers in ``nid``'s configuration: every peer it links to but the hosts
        gone for good. (Its dialers keep trying those, in vain, as a link to a dead
        host does; only what the core waits for changes.)"""
        return [p for p in self.peers[nid] if p not in self.gone]

    def move_ranks(self, placement: Placement, why: str) -> int:
        """The job relaunches with its ranks on ``placement`` (`launches`); returns
        the launch's number."""
        old = self.placement.hosts
        self.job.moved({r for r, n in placement.hosts.items() if old.get(r) != n})
        self.placement = placement
        self.loop.trace(f"fault {why} {sorted(placement.members().items())}")
        if self.cfg.compare:
            self.baselines.sample(reschedule=False)
        return self.launches.relaunch()
