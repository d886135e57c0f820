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
Daemons crash, restart, lose their state or die for good as `lives` says; the job
relaunches, on the same member map or a new one, as `launches` says.
"""

from __future__ import annotations

import gc
from functools import partial

from convergenced.core.decoded_cache import DECODED_CAPACITY, set_decoded_capacity
from convergenced.core.facts import Commit, Declare, Fact
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import LinkConfig
from convergenced.core.local_api_codec import ApiError
from convergenced.core.node import GenerationResolved, NodeCore, RestorePointChanged
from convergenced.core.overlay import links
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.versions import is_reserved
from convergenced.sim.baselines import Baselines
from convergenced.sim.config import Result, SimConfig
from convergenced.sim.faults import (
    FAULT_STEP,
    FAULTS,
    MEMBERSHIP_FAULTS,
    FaultInjector,
    churn_plan,
    churn_spares,
)
from convergenced.sim.job import Job
from convergenced.sim.launches import Launches
from convergenced.sim.liveness import Liveness, liveness_bound
from convergenced.sim.lives import DaemonLives
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Connection, Network, pair
from convergenced.sim.node import LogWrite, SimNode
from convergenced.sim.oracle import InvariantViolation, Truth
from convergenced.sim.placement import Placement
from convergenced.sim.rollouts import Rollout
from convergenced.sim.storage import Storage
from convergenced.sim.versions import SimVersions
from convergenced.sim.workload import domain_models, domain_names

__all__ = ["FAULTS", "STREAM", "Result", "SimConfig", "Simulation", "liveness_bound"]

_GC_GEN0 = 100_000
"""Young-generation threshold of the cyclic GC while a run is going (see `run`)."""
ARCHIVE_SIZE = 2_000
"""Records kept for the replay fault (a reservoir of what links merged)."""
FAST_FSYNC_US = 100
"""The disk's latency once faults stop (and for the final commits)."""
SPARES = 2
"""Spare nodes of a cluster whose faults change the membership (none otherwise; more
when a churn plan needs them: `faults.churn_spares`)."""
MEMBERSHIP_SHARE = 1 / 4
"""With every fault enabled, the share of seeds that change the membership (the
others run without them, and without spares: two spares more than double a run's
messages)."""
SHARED_TIER = 0.75
"""The share of seeds whose policy names a shared domain (an object store)."""


class Simulation(DaemonLives):
    """One seeded run. Call `run`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.loop = EventLoop(cfg.seed)
        rng = self.loop.rng
        self.result = Result(cfg.seed)
        self.phase = "safety"
        faults = cfg.faults
        every = faults >= set(FAULTS)
        if cfg.rollout:  # the rollout moves the versions: the upgrade fault stays off
            faults -= {"upgrade"}
        moves = "upgrade" in faults or bool(cfg.rollout)
        self.versions = SimVersions(self, cfg.seed, enabled=moves,
                                    sampled=every and not cfg.rollout)  # fmt: skip
        if cfg.rollout:
            self.versions.rate = 0.0
        if every and not cfg.churn and rng.random() >= MEMBERSHIP_SHARE:
            faults -= MEMBERSHIP_FAULTS  # swarm testing: off in this seed
        plan = churn_plan(faults, cfg.churn)
        if cfg.churn and not plan:
            raise ValueError("churn needs a membership fault: replace, shrink, grow or leave")
        spares = max(SPARES, churn_spares(plan)) if faults & MEMBERSHIP_FAULTS else 0
        total = cfg.nodes + spares
        ids = [f"n{i:02d}" if total <= 100 else f"n{i:04d}" for i in range(total)]
        self.ids = ids
        """Every node of the cluster: the job's first members, then the spares."""
        catalogues = tuple(self.versions.catalogues())
        self.nodes = {
            i: SimNode(i, catalogues=catalogues, credentials=cfg.credentials) for i in ids
        }
        # Every node of the run decodes in this process: let the wire codec keep every
        # record version still in flight decoded once, for all of them.
        set_decoded_capacity(max(DECODED_CAPACITY, 16 * total))
        self.pairs = links(ids, cfg.mesh_limit)
        self.peers: dict[str, list[str]] = {i: [] for i in ids}
        for a, b in self.pairs:
            self.peers[a].append(b)
            self.peers[b].append(a)
        self._pair_keys = {i: [pair(i, p) for p in self.peers[i]] for i in ids}
        """Per node, the keys of its connections, in the order of its peers."""
        self.link_config = LinkConfig(cluster="sim", idle_ticks=1, dead_ticks=10)
        names, shared = domain_names(cfg.domains, rng.random() < SHARED_TIER)
        self.domains = domain_models(cfg.domains, rng, names)
        policy = rng.choice(
            [Policy.all_of(names[-1]), Policy.all_of(*names[1:]), Policy.any_of(*names[-2:])]
            if len(names) >= 2
            else [Policy.all_of(names[0])]
        )
        # Ranks save only to the domains the policy names (the daemon refuses commits
        # elsewhere: `core.admission`), each at its own pace.
        self.domains = [d for d in self.domains if d.name in policy.domains]
        self.placement = Placement(
            {r: nid for k, nid in enumerate(ids[: cfg.nodes])
             for r in range(k * cfg.ranks_per_node, (k + 1) * cfg.ranks_per_node)}
        )  # fmt: skip
        """Where the job's ranks run now (a membership change moves them)."""
        self.spec = StreamSpec.create(
            STREAM, self.placement.members(), policy, retention=rng.choice([0, 1, 3]),
            shared=[d for d in policy.domains if d in shared],
        )  # fmt: skip
        """The spec the job declared last (its member map lags the placement while a
        relaunch that moved ranks has not handed out its generation yet)."""
        self.truth = Truth(self.spec, Storage(self.spec.shared))
        self.gone: set[str] = set()
        """Nodes that died for good (replaced, or gone with a member that left)."""
        self.faults = FaultInjector(self, faults, churn=cfg.churn)
        self.job = Job(self, period_us=cfg.period_us, until_us=cfg.safety_us)
        self.launches = Launches(self)
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
        self.baselines = Baselines(self, cfg.compare)
        self.rollout = Rollout(self, cfg.rollout) if cfg.rollout else None
        self._check_all = cfg.check_every_event and cfg.nodes <= 64
        self._rp_moved = False
        self.closed_below: dict[str, int] = {}
        """Per node, over all its lives: generations below this are closed."""
        self.amnesiac: set[str] = set()
        """Nodes that lost their state and have not heard from every member since."""
        self.undeclared: dict[str, bool] = {}
        """Nodes whose job undeclared the stream, until it is declared again."""
        self.undeclares: dict[str, int] = {}
        """Per node, how often its job undeclared the stream (a point reported before
        belongs to the stream it undeclared)."""
        self.resolved: dict[bytes, int] = {}
        """Per spec digest, the newest generation any node resolved under that spec,
        in any life."""
        # What passed the oracle's checks of each node, to skip repeating a check on
        # the same inputs (speed only: the same checks fail at the same events).
        self._held_ok: dict[str, tuple[NodeCore, int, int]] = {}
        self._revealed_ok: dict[str, tuple[Record, int | None, dict[int, IntervalSet], int]] = {}

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
        except Exception as exc:  # a bug the run hit: its seed is a failure to replay
            r.violation = InvariantViolation("error", f"{type(exc).__name__}: {exc}")
        finally:
            gc.set_threshold(*thresholds)
        r.messages, r.bytes = self.net.messages, self.net.bytes
        r.events = self.loop.events_run
        r.virtual_us = self.loop.now
        r.trace_hash = self.loop.trace_hash
        r.trace_tail = self.loop.trace_tail
        r.fault_counts = dict(self.faults.counts)
        r.refused_records = sum(n.refused for n in self.nodes.values())
        r.compare = dict(self.baselines.counts)
        if self.rollout is not None:
            r.compare |= {f"rollout_{k}": v for k, v in self.rollout.counts.items()}
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

    def _check_point(
        self, nid: str, rp: int | None, rollback: bool, spec: StreamSpec, declared: int
    ) -> None:
        # After an undeclaration, S3 follows the new stream of the same name.
        same = declared == self.undeclares.get(nid, 0)
        self.truth.check_restore_point(nid, rp, rollback, spec, same_stream=same)

    def _check_current_points(self) -> None:
        # A node's restore point and spec only change with a new version of its own
        # record (`NodeCore` publishes after every change), so a node whose core and
        # view are where they were when it passed, against an unchanged truth, passes.
        version = self.truth.version
        passed = self._held_ok
        for nid in self.ids:
            node = self.nodes[nid]
            core = node.core
            if core is None:
                continue
            seq = core.view.seq
            last = passed.get(nid)
            if last is not None and last[0] is core and last[1] == seq and last[2] == version:
                continue
            if STREAM not in core.streams() or node.busy():
                continue  # its point may rest on facts still on their way to disk
            self.truth.check_held(nid, core.restore_point(STREAM), core.spec(STREAM))
            passed[nid] = (core, seq, version)

    # -- setup ------------------------------------------------------------------

    def _start(self) -> None:
        loop, rng = self.loop, self.loop.rng
        self.faults.skew_clocks()
        for nid in self.ids:
            node = self.nodes[nid]
            node.boot(self.peers[nid], self.ids)
            if nid in self.spec.member_ids:  # a spare holds no stream until used
                loop.at(rng.randint(0, 20_000), self._declare, nid)
            loop.at(rng.randint(0, self.cfg.tick_us), self._tick, nid, node.lives)
        for a, b in self.pairs:
            loop.at(rng.randint(0, 5_000), self.net.connect, a, b)
        if self.cfg.workload:
            self.job.start(self.ids)
        loop.at(FAULT_STEP, self._fault_step)
        self.faults.schedule_churn(self.cfg.safety_us)
        if self.cfg.compare:
            self.baselines.start()
        if self.rollout is not None:
            self.rollout.start()

    def _declare(self, nid: str) -> None:
        """The job's ranks on ``nid`` declare its spec (a node it left declares none)."""
        if nid in self.spec.member_ids:
            self.submit(nid, Declare(self.spec))
            self.versions.report(nid)

    def _fault_step(self) -> None:
        if self.phase != "safety":
            return
        self.loop.after(FAULT_STEP, self._fault_step)
        self.faults.step()

    # -- a daemon's inputs and outputs ---------------------------------------------

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A rank of ``nid`` submits ``fact`` (through the daemon's admission).
        Returns the reason when the daemon refused it (``down``: no daemon runs); a
        paused one takes it later."""
        node = self.nodes[nid]
        if node.admission is None:
            return "down"  # the daemon is down: the rank gets no ack
        loop = self.loop
        if node.paused_until > loop.now:
            self.deferred += 1
            loop.at(node.paused_until, self._submit_later, nid, fact, node.lives)
            return None
        try:
            admitted = node.admission.submit(fact)
        except ApiError as err:  # typed refusals are fine; they change nothing
            loop.trace(f"refused {nid} {type(fact).__name__} {err.reason}")
            return err.reason
        if admitted.repeat:  # held already: acknowledged, nothing applied
            loop.trace(f"repeat {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
            return None
        loop.trace(f"apply {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
        self.after_change(nid)
        return None

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
            if is_reserved(getattr(ev, "stream", "")):
                # A version acknowledged for the job: checked as a client reads it.
                if isinstance(ev, RestorePointChanged) and ev.new is not None:
                    node.reply(partial(self.versions.check_acknowledged, nid, ev.new,
                                       core.spec(ev.stream)))  # fmt: skip
                continue
            # Judged by the member map the node holds (the job's, or an older one it
            # keeps as a node the job left).
            spec = core.spec(STREAM) if STREAM in core.streams() else self.spec
            if isinstance(ev, RestorePointChanged):
                self._rp_moved = True
                self.loop.trace(f"rp {nid} {ev.old}->{ev.new}{' rollback' if ev.rollback else ''}")
                # Checked as it is reported (a status, a watch event): behind the gate.
                # A node that is its stream's only member moves its point on commits
                # of its own still on their way to disk.
                node.reply(partial(self._check_point, nid, ev.new, ev.rollback, spec,
                                   self.undeclares.get(nid, 0)))  # fmt: skip
            elif isinstance(ev, GenerationResolved):
                self.loop.trace(f"gen {nid} g{ev.generation}={ev.restore_point}")
                # Checked as the rank gets it: behind the gate, like any answer (the
                # frozen set may rest on commits of our own still on their way to disk).
                node.reply(partial(self.truth.check_generation, nid, ev.generation,
                                   ev.restore_point, spec))  # fmt: skip
                if ev.generation > self.closed_below.get(nid, 0):
                    self.closed_below[nid] = ev.generation
                self.resolved[spec.digest] = max(self.resolved.get(spec.digest, -1),
                                                 ev.generation)  # fmt: skip
        # Other links only have something new to say when the view changed.
        if core.view.seq != node.polled_seq:
            node.polled_seq = core.view.seq
            conns, flush = self.net.conns, self.net.flush
            for key in self._pair_keys[nid]:
                conn = conns.get(key)
                if conn is not None and conn.alive:
                    conn.links[nid].poll()
                    flush(conn, nid)
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
        conns = self.net.conns
        for key in self._pair_keys[nid]:
            conn = conns.get(key)
            if conn is not None and conn.alive:
                self.net.release(conn, nid)
        self._write(nid)  # what arrived meanwhile: the next group

    def _durable(self, nid: str, fact: Fact) -> None:
        """``fact`` of ``nid`` is durable: a commit is acknowledged to its rank."""
        self.loop.trace(f"durable {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
        if not isinstance(fact, Commit):
            return
        truth = self.truth
        truth.storage.acknowledged(nid, fact.rank, fact.domain, fact.epoch)
        truth.acked[(nid, fact.rank, fact.domain)].add(fact.epoch)
        truth.touch()
        if self.cfg.compare:
            self.baselines.acknowledged(nid, fact.rank, fact.domain, fact.epoch)
        if self.liveness.acknowledged(fact.epoch):
            self._rp_moved = True  # the target is fixed: check it now

    def _check_sent(self, nid: str, own: Record | None) -> None:
        if own is None:
            return
        node = self.nodes[nid]
        hw, frozen, version = node.durable_high_water, node.durable_frozen, self.truth.version
        # The same record against the same disk passes again: acknowledgements only
        # accumulate, and a disk's frozen sets are only added to (a lost disk is a new
        # dict). Anything else is checked.
        last = self._revealed_ok.get(nid)
        if last is not None and last[0] is own and last == (own, hw, frozen, version):
            return
        self.truth.check_revealed(nid, own, hw, frozen)
        self._revealed_ok[nid] = (own, hw, frozen, version)

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
        conns, flush = self.net.conns, self.net.flush
        for key in self._pair_keys[nid]:
            conn = conns.get(key)
            if conn is not None and conn.alive:
                conn.links[nid].on_timer()
                flush(conn, nid)
