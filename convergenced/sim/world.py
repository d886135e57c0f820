"""The simulated cluster: one seed's nodes, workload, faults and checks.

One `Simulation` is one seed. It runs the real daemon logic (`SimNode`: the core,
admission and the output gate) over a simulated network (`network`) in virtual
time (`loop`), injects faults (`faults`) and has the oracle (`oracle`) check S1-S5
and the gate against ground truth: after every event, where a restore point, a
generation answer or a deletion happens, and on every record a node sends. Same
seed and same code give the same trace hash.

A run has two phases. In the *safety* phase ranks train and save, the job deletes
what the daemons allow, and faults strike; only S1-S4 and the gate can fail there.
Then the network heals, every daemon comes back, every rank commits one final epoch
and the *liveness* phase (S5, `liveness`) requires every node to reach the newest
epoch of the true convergence interval within a bound of handshake rounds. With
``--compare``, `baselines` scores what other tools would have restored meanwhile.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from functools import partial

from convergenced.core.facts import Commit, Declare, Fact, Undeclare
from convergenced.core.link import LinkConfig
from convergenced.core.local_api_codec import ApiError
from convergenced.core.node import GenerationResolved, RestorePointChanged
from convergenced.core.overlay import DEFAULT_MESH_LIMIT, links
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec
from convergenced.sim.baselines import Baselines
from convergenced.sim.faults import FAULT_STEP, FAULTS, FaultInjector
from convergenced.sim.job import Job
from convergenced.sim.liveness import Liveness, liveness_bound
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Connection, Network
from convergenced.sim.node import LogWrite, SimNode
from convergenced.sim.oracle import InvariantViolation, Truth
from convergenced.sim.workload import domain_models

__all__ = ["FAULTS", "STREAM", "Result", "SimConfig", "Simulation", "liveness_bound"]

_GC_GEN0 = 100_000
"""Young-generation threshold of the cyclic GC while a run is going (see `run`)."""
ARCHIVE_SIZE = 2_000
"""Records kept for the replay fault (a reservoir of what links merged)."""
FAST_FSYNC_US = 100
"""The disk's latency once faults stop (and for the final commits)."""


@dataclass(frozen=True)
class SimConfig:
    """What one run simulates."""

    nodes: int = 4
    seed: int = 0
    faults: frozenset[str] = frozenset(FAULTS)
    ranks_per_node: int = 2
    domains: int = 3
    safety_us: int = 400_000
    """Length of the faulty phase, virtual microseconds."""
    liveness_limit_us: int = 5_000_000
    latency_us: int = 200
    tick_us: int = 10_000
    period_us: int = 8_000
    """Training step period of each rank."""
    mesh_limit: int = DEFAULT_MESH_LIMIT
    compare_marker: bool = False
    check_every_event: bool = True
    """Re-check S1 on every node's current restore point after every event (on top of
    the checks made where a restore point, a generation answer or a deletion
    happens). Skipped past 64 nodes, where it would dominate the run time."""
    workload: bool = True
    """False: only the final commit of the liveness phase (for scale runs)."""


@dataclass
class Result:
    """What a run found."""

    seed: int
    violation: InvariantViolation | None = None
    converged: bool = False
    rounds_to_converge: int | None = None
    messages: int = 0
    bytes: int = 0
    events: int = 0
    virtual_us: int = 0
    trace_hash: str = ""
    trace_tail: list[str] = field(default_factory=list)
    fault_counts: dict[str, int] = field(default_factory=dict)
    marker_samples: int = 0
    marker_invalid: int = 0
    convergence_invalid: int = 0
    restore_point: int | None = None
    bytes_per_node_per_round: float = 0.0


class Simulation:
    """One seeded run. Call `run`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.loop = EventLoop(cfg.seed)
        rng = self.loop.rng
        self.result = Result(cfg.seed)
        self.phase = "safety"
        ids = [f"n{i:02d}" if cfg.nodes <= 100 else f"n{i:04d}" for i in range(cfg.nodes)]
        self.ids = ids
        self.nodes = {i: SimNode(i) for i in ids}
        self.pairs = links(ids, cfg.mesh_limit)
        self.peers: dict[str, list[str]] = {i: [] for i in ids}
        for a, b in self.pairs:
            self.peers[a].append(b)
            self.peers[b].append(a)
        self.link_config = LinkConfig(cluster="sim", idle_ticks=1, dead_ticks=10)
        self.domains = domain_models(cfg.domains, rng)
        names = [d.name for d in self.domains]
        policy = rng.choice(
            [Policy.all_of(names[-1]), Policy.all_of(*names[1:]), Policy.any_of(*names[-2:])]
            if len(names) >= 2
            else [Policy.all_of(names[0])]
        )
        # Ranks save only to the domains the policy names (the daemon refuses commits
        # elsewhere: `core.admission`), each at its own pace.
        self.domains = [d for d in self.domains if d.name in policy.domains]
        members = {
            nid: range(k * cfg.ranks_per_node, (k + 1) * cfg.ranks_per_node)
            for k, nid in enumerate(ids)
        }
        self.spec = StreamSpec.create(STREAM, members, policy, retention=rng.choice([0, 1, 3]))
        self.truth = Truth(self.spec)
        self.faults = FaultInjector(self, cfg.faults)
        self.job = Job(self, period_us=cfg.period_us, until_us=cfg.safety_us)
        self.net = Network(
            self.loop,
            self.nodes,
            self.link_config,
            cfg.latency_us,
            on_change=self.after_change,
            on_merged=self._archive,
            on_sent=self._check_sent,
        )
        self.archive: list[Record] = []
        self.deferred = 0
        """Facts a paused daemon will take once it runs again."""
        self.latency_us = cfg.latency_us
        self.liveness = Liveness(self)
        self.baselines = Baselines(self)
        self._check_all = cfg.check_every_event and cfg.nodes <= 64
        self._rp_moved = False
        self.closed_below: dict[str, int] = {}
        self.amnesiac: set[str] = set()
        """Nodes that lost their state and have not heard from every member since."""
        self.undeclared: dict[str, bool] = {}
        """Nodes whose job undeclared the stream, until it is declared again."""
        """Per node, over all its lives: generations below this are closed."""
        self.resolved_anywhere = -1
        """The newest generation any node resolved, in any life (-1: none)."""

    @property
    def conns(self) -> dict[tuple[str, str], Connection]:
        """Every connection made so far, by sorted pair."""
        return self.net.conns

    # -- running ----------------------------------------------------------------

    def run(self) -> Result:
        """Run the safety phase, then the liveness phase; return the result."""
        r = self.result
        # Performance only (the run does not depend on it): a run allocates millions
        # of short-lived objects (frames, decoded records) while its heap of live
        # records keeps growing, and at the default threshold (700) the cyclic
        # collector rescans that heap so often that it costs about a fifth of the CPU
        # time of a 256-node run (a few percent at 128 nodes).
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], _GC_GEN0), *thresholds[1:])
        try:
            self._start()
            self.loop.run_until(self.cfg.safety_us, self._after_event)
            self.liveness.begin()
            end = self.cfg.safety_us + self.cfg.liveness_limit_us
            self.loop.run_until(end, self._after_event)
            if not r.converged:
                raise self.liveness.failure()
        except InvariantViolation as v:
            r.violation = v
        finally:
            gc.set_threshold(*thresholds)
        r.messages, r.bytes = self.net.messages, self.net.bytes
        r.events = self.loop.events_run
        r.virtual_us = self.loop.now
        r.trace_hash = self.loop.trace_hash
        r.trace_tail = self.loop.trace_tail
        r.fault_counts = dict(self.faults.counts)
        b = self.baselines
        r.marker_samples, r.marker_invalid = b.samples, b.marker_invalid
        r.convergence_invalid = b.convergence_invalid
        return r

    def _after_event(self) -> bool:
        if self._check_all:
            self._check_current_points()
        if self._rp_moved and self.liveness.t_final is not None:
            self._rp_moved = False
            return self._converged()
        return False

    def _converged(self) -> bool:
        live = self.liveness
        if not live.converged():
            return False
        r = self.result
        r.converged = True
        r.restore_point = live.want
        assert live.rounds is not None
        r.rounds_to_converge = live.rounds
        live.check_bound()
        spent = self.net.bytes - live.bytes_at_final
        r.bytes_per_node_per_round = spent / len(self.ids) / live.rounds
        return True

    def _check_current_points(self) -> None:
        truth = self.truth
        for nid in self.ids:
            core = self.nodes[nid].core
            if core is None or STREAM not in core.streams():
                continue
            rp = core.restore_point(STREAM)
            if rp is not None and not truth.valid(rp):
                raise InvariantViolation(
                    "S1", f"{nid} holds restore point {rp}, no longer valid in the truth"
                )

    # -- setup ------------------------------------------------------------------

    def _start(self) -> None:
        loop, rng = self.loop, self.loop.rng
        self.faults.skew_clocks()
        for nid in self.ids:
            node = self.nodes[nid]
            node.boot(self.peers[nid], self.ids)
            loop.at(rng.randint(0, 20_000), self._declare, nid)
            loop.at(rng.randint(0, self.cfg.tick_us), self._tick, nid, node.lives)
        for a, b in self.pairs:
            loop.at(rng.randint(0, 5_000), self.net.connect, a, b)
        if self.cfg.workload:
            for nid in self.ids:
                self.job.start(nid)
        loop.at(FAULT_STEP, self._fault_step)
        if self.cfg.compare_marker:
            self.baselines.start()

    def _declare(self, nid: str) -> None:
        self.submit(nid, Declare(self.spec))

    def _fault_step(self) -> None:
        if self.phase != "safety":
            return
        self.loop.after(FAULT_STEP, self._fault_step)
        self.faults.step()

    # -- a daemon's inputs and outputs ---------------------------------------------

    def submit(self, nid: str, fact: Fact) -> None:
        """A rank of ``nid`` submits ``fact`` (through the daemon's admission)."""
        node = self.nodes[nid]
        if node.admission is None:
            return  # the daemon is down: the rank gets no ack
        loop = self.loop
        if node.paused_until > loop.now:
            self.deferred += 1
            loop.at(node.paused_until, self._submit_later, nid, fact, node.lives)
            return
        try:
            admitted = node.admission.submit(fact)
        except ApiError as err:  # typed refusals are fine; they change nothing
            loop.trace(f"refused {nid} {type(fact).__name__} {err.reason}")
            return
        if admitted.repeat:  # held already: acknowledged, nothing applied
            loop.trace(f"repeat {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
            return
        loop.trace(f"apply {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
        self.after_change(nid)

    def _submit_later(self, nid: str, fact: Fact, life: int) -> None:
        self.deferred -= 1
        if self.nodes[nid].lives == life:  # else the request died with that daemon
            self.submit(nid, fact)

    def after_change(self, nid: str) -> None:
        """``nid``'s core may have changed: check its events, let its links speak,
        and start the log write that will let their bytes leave."""
        node = self.nodes[nid]
        core = node.core
        if core is None:
            return
        while (ev := core.next_event()) is not None:
            if isinstance(ev, RestorePointChanged):
                self._rp_moved = True
                self.loop.trace(f"rp {nid} {ev.old}->{ev.new}{' rollback' if ev.rollback else ''}")
                self.truth.check_restore_point(nid, ev.new, ev.rollback)
            elif isinstance(ev, GenerationResolved):
                self.loop.trace(f"gen {nid} g{ev.generation}={ev.restore_point}")
                # Checked as the rank gets it: behind the gate, like any answer (the
                # frozen set may rest on commits of our own still on their way to disk).
                node.reply(partial(self.truth.check_generation, nid, ev.generation,
                                   ev.restore_point))  # fmt: skip
                if ev.generation > self.closed_below.get(nid, 0):
                    self.closed_below[nid] = ev.generation
                self.resolved_anywhere = max(self.resolved_anywhere, ev.generation)
        # Other links only have something new to say when the view changed.
        if core.view.seq != node.polled_seq:
            node.polled_seq = core.view.seq
            for peer in self.peers[nid]:
                conn = self.net.get(nid, peer)
                if conn is not None:
                    conn.links[nid].poll()
                    self.net.flush(conn, nid)
        self._write(nid)

    def _write(self, nid: str) -> None:
        node = self.nodes[nid]
        write = node.start_write()
        if write is not None:
            calm = self.phase != "safety"
            delay = FAST_FSYNC_US if calm else self.loop.rng.randint(100, 2_000)
            self.loop.after(delay, self._written, nid, write)

    def _written(self, nid: str, write: LogWrite) -> None:
        node = self.nodes[nid]
        if not node.finish_write(write):
            return  # crashed before the fsync returned: lost, never acknowledged
        for fact in write.facts:
            self._durable(nid, fact)
        for act in node.released_replies():
            act()
        for peer in self.peers[nid]:
            conn = self.net.get(nid, peer)
            if conn is not None:
                self.net.release(conn, nid)
        self._write(nid)  # what arrived meanwhile: the next group

    def _durable(self, nid: str, fact: Fact) -> None:
        """``fact`` of ``nid`` is durable: a commit is acknowledged to its rank."""
        self.loop.trace(f"durable {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
        if not isinstance(fact, Commit):
            return
        truth = self.truth
        key = (fact.rank, fact.domain)
        truth.ever[key].add(fact.epoch)
        truth.touch()
        if fact.epoch not in truth.retired[key]:
            truth.available[key].add(fact.epoch)
        if self.liveness.acknowledged(fact.epoch):
            self._rp_moved = True  # the target is fixed: check it now

    def _check_sent(self, nid: str, own: Record | None) -> None:
        if own is not None:
            node = self.nodes[nid]
            self.truth.check_revealed(nid, own, node.durable_high_water, node.durable_frozen)

    def _archive(self, records: tuple[Record, ...]) -> None:
        archive, rng = self.archive, self.loop.rng
        for rec in records:
            if len(archive) < ARCHIVE_SIZE:
                archive.append(rec)
            else:
                archive[rng.randrange(ARCHIVE_SIZE)] = rec

    def _tick(self, nid: str, life: int) -> None:
        node = self.nodes[nid]
        if not node.up or node.lives != life:
            return
        self.loop.after(int(self.cfg.tick_us * node.skew), self._tick, nid, life)
        if node.paused_until > self.loop.now:
            return
        for peer in self.peers[nid]:
            conn = self.net.get(nid, peer)
            if conn is not None:
                conn.links[nid].on_timer()
                self.net.flush(conn, nid)

    # -- life and death of a daemon ------------------------------------------------

    def crash(self, nid: str, *, state_lost: bool = False) -> None:
        """``nid``'s daemon dies: what its log did not make durable is gone."""
        node = self.nodes[nid]
        node.crash()
        self.truth.crashed(nid, node.durable_high_water, state_lost=state_lost)
        self.loop.trace(f"fault crash {nid}")
        if self.cfg.compare_marker:
            self.baselines.sample(reschedule=False)
        self.net.node_down(nid, self.peers[nid])

    def lose_state(self, nid: str, *, floor_too: bool = False) -> None:
        """``nid``'s daemon dies and its state directory is lost (its identity key and
        its checkpoints survive; the incarnation floor too unless ``floor_too``); it
        comes back later, from an empty log."""
        self.crash(nid, state_lost=True)
        self.nodes[nid].wipe_disk(floor_too=floor_too)
        self.amnesiac.add(nid)
        self.truth.retractions += 1  # a loss: the restore point may move back (S3)
        self.loop.trace(f"fault lose_state {nid}{' and floor' if floor_too else ''}")

    def would_forget_everything(self, nid: str) -> bool:
        """Whether losing ``nid``'s state now would leave no member that remembers the
        stream's past: every other one lost its state too and has not heard from the
        others since. Nothing can be recovered then (PROTOCOL.md 13.9), so the
        ``lose_state`` fault never does that."""
        for n in list(self.amnesiac):
            core = self.nodes[n].core
            if core is not None and STREAM in core.streams() and not core.waiting_to_freeze(STREAM):
                self.amnesiac.discard(n)  # it heard from the others: it knows again
        return not set(self.ids) - self.amnesiac - {nid}

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
        self.closed_below[nid] = max(self.closed_below.get(nid, 0),
                                     core.generations_closed_below(STREAM))  # fmt: skip
        if not keep_checkpoints:
            for rank in self.spec.ranks_of(nid):
                for d in self.domains:
                    self.truth.available[(rank, d.name)].clear()
        self.undeclared[nid] = True
        self.after_change(nid)
        self.loop.after(self.loop.rng.randint(5_000, 100_000), self._redeclare, nid, node.lives)

    def _redeclare(self, nid: str, life: int) -> None:
        node = self.nodes[nid]
        if node.lives != life or not node.up or not self.undeclared.pop(nid, False):
            return  # down, or restarted meanwhile: `restart` declares it again
        self._declare(nid)
        if self.phase == "safety":
            self.job.recommit(nid)

    def restart(self, nid: str) -> None:
        """``nid``'s daemon starts again, from its log, at the next incarnation."""
        node = self.nodes[nid]
        if node.up:
            return
        lost = not node.durable
        node.boot(self.peers[nid], self.ids)
        node.paused_until = 0
        loop = self.loop
        core = node.core
        assert core is not None
        loop.trace(f"restart {nid} inc {core.incarnation}")
        self._write(nid)  # replay may have produced facts of the core's own
        if STREAM not in core.streams():
            self._declare(nid)  # the job declares again when it reconnects
            if (lost or self.undeclared.pop(nid, False)) and self.phase == "safety":
                self.job.recommit(nid)
        loop.after(loop.rng.randint(0, self.cfg.tick_us), self._tick, nid, node.lives)
        for peer in self.peers[nid]:
            a, b = (nid, peer) if nid < peer else (peer, nid)
            loop.after(loop.rng.randint(0, 5_000), self.net.connect, a, b)

    def recovery(self) -> None:
        """The job is relaunched: it asks for a new recovery generation (`job`)."""
        self.job.recovery()
