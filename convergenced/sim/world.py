"""The simulated cluster: nodes, connections, virtual time, faults and workload.

One `Simulation` is one seed. Everything random comes from one `random.Random`
seeded with it, time is an integer count of virtual microseconds, and events run
from a heap in (time, sequence) order, so a run is a pure function of seed, config
and code. The trace hash digests every event that happens.

Faults follow swarm testing (as in FoundationDB's simulator and TigerBeetle's
VOPR): each enabled fault gets a rate drawn per seed, so some seeds hammer one
fault and barely touch another.
"""

from __future__ import annotations

import gc
import hashlib
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from convergenced.core.errors import ProtocolError
from convergenced.core.facts import Commit, Declare, Fact, Freeze, HighWater, Retire, Retract
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import Closed, Link, LinkConfig, RecordsMerged, Role
from convergenced.core.node import (
    GenerationResolved,
    NodeCore,
    RestorePointChanged,
)
from convergenced.core.overlay import DEFAULT_MESH_LIMIT, links
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec
from convergenced.sim.oracle import InvariantViolation, Truth
from convergenced.sim.workload import RankSchedule, domain_models

FAULTS = ("reset", "delay", "clog", "partition", "crash", "pause", "skew", "replay", "retract")
"""Every fault the simulator can inject (``--faults all``)."""

# Per fault, the range its rate is drawn from: chance per fault step (every 10 ms).
_RATE_RANGES: dict[str, tuple[float, float]] = {
    "reset": (0.0, 0.25),
    "delay": (0.0, 0.3),
    "clog": (0.0, 0.1),
    "partition": (0.0, 0.08),
    "crash": (0.0, 0.08),
    "pause": (0.0, 0.1),
    "skew": (0.0, 1.0),
    "replay": (0.0, 0.5),
    "retract": (0.0, 0.15),
}
FAULT_STEP = 10_000
STREAM = "job"
_GC_GEN0 = 100_000
"""Young-generation threshold of the cyclic GC while a run is going (see `run`)."""


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


class _Conn:
    """A simulated TCP connection: two Links and in-order byte delivery."""

    def __init__(self, sim: Simulation, a: str, b: str) -> None:
        self.sim = sim
        self.a, self.b = a, b
        self.alive = True
        na, nb = sim.nodes[a], sim.nodes[b]
        assert na.core is not None and nb.core is not None
        cfg = sim.link_config
        self.links = {a: Link(na.core, Role.INITIATOR, cfg), b: Link(nb.core, Role.ACCEPTOR, cfg)}
        self.last_delivery = {a: 0, b: 0}  # per receiving side
        self.inflight: dict[str, deque[tuple[int, bytes]]] = {a: deque(), b: deque()}
        self.slow_until = 0
        self.slow_factor = 1
        # Bumped when in-flight bytes are re-timed: older delivery events lapse.
        self.timing = {a: 0, b: 0}
        self.established_at: int | None = None

    def other(self, side: str) -> str:
        return self.b if side == self.a else self.a


class _Node:
    def __init__(self, node_id: str) -> None:
        self.id = node_id
        self.incarnation = 1
        self.core: NodeCore | None = None
        self.durable: list[Fact] = []
        self.crashes = 0
        self.paused_until = 0
        self.skew = 1.0
        self.backoff: dict[str, int] = {}
        self.queue: list[Fact] = []
        """Facts waiting for the next group fsync."""
        self.fsync_pending = False
        self.polled_seq = -1
        self.high_water: int | None = None
        """The highest durable HighWater fact (kept with `durable`, survives crashes)."""


class Simulation:
    """One seeded run. Call `run`."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        rng = self.rng
        self.now = 0
        self._q: list[tuple[int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._trace = hashlib.sha256()
        self._tail: deque[str] = deque(maxlen=30)
        self.result = Result(cfg.seed)
        self.phase = "safety"
        ids = [f"n{i:02d}" if cfg.nodes <= 100 else f"n{i:04d}" for i in range(cfg.nodes)]
        self.ids = ids
        self.nodes = {i: _Node(i) for i in ids}
        self.pairs = links(ids, cfg.mesh_limit)
        self.neighbours: dict[str, list[str]] = {i: [] for i in ids}
        for a, b in self.pairs:
            self.neighbours[a].append(b)
            self.neighbours[b].append(a)
        self.conns: dict[tuple[str, str], _Conn] = {}
        self.link_config = LinkConfig(cluster="sim", idle_ticks=1, dead_ticks=10)
        self.domains = domain_models(cfg.domains, rng)
        names = [d.name for d in self.domains]
        policy = rng.choice(
            [Policy.all_of(names[-1]), Policy.all_of(*names[1:]), Policy.any_of(*names[-2:])]
            if len(names) >= 2
            else [Policy.all_of(names[0])]
        )
        members = {
            nid: range(k * cfg.ranks_per_node, (k + 1) * cfg.ranks_per_node)
            for k, nid in enumerate(ids)
        }
        self.spec = StreamSpec.create(STREAM, members, policy, retention=rng.choice([0, 1, 3]))
        self.truth = Truth(self.spec)
        self.rates = {
            f: (rng.uniform(*_RATE_RANGES[f]) if f in cfg.faults else 0.0) for f in FAULTS
        }
        self.blocked: set[tuple[str, str]] = set()
        self.blocked_until = 0
        self.archive: list[Record] = []
        self.generation = 0
        self.final_epoch: int | None = None
        self.final_acks = 0
        self.t_final: int | None = None
        self.outstanding = 0
        self._check_all = cfg.check_every_event and cfg.nodes <= 64
        self._rp_moved = False
        self._want: int | None = None
        self._bytes_at_final = 0
        self.closed_below: dict[str, int] = {}
        """Per node, over all its lives: generations below this are closed."""
        """Facts on their way to durability (the final commit waits for none)."""

    # -- event loop -----------------------------------------------------------

    def at(self, t: int, fn: Callable[..., None], *args: Any) -> None:
        """Schedule ``fn(*args)`` at virtual time ``t``."""
        self._seq += 1
        heapq.heappush(self._q, (max(t, self.now), self._seq, fn, args))

    def trace(self, text: str) -> None:
        """Record an event in the trace hash and the short tail shown on failure."""
        line = f"{self.now} {text}"
        self._trace.update(line.encode())
        self._tail.append(line)

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
            self._loop(self.cfg.safety_us)
            self._begin_liveness()
            self._loop(self.cfg.safety_us + self.cfg.liveness_limit_us, until_converged=True)
            if not r.converged:
                self._liveness_failure()
        except InvariantViolation as v:
            r.violation = v
        finally:
            gc.set_threshold(*thresholds)
        r.virtual_us = self.now
        r.trace_hash = self._trace.hexdigest()[:16]
        r.trace_tail = list(self._tail)
        return r

    def _loop(self, t_end: int, until_converged: bool = False) -> None:
        q = self._q
        while q and q[0][0] <= t_end:
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            self.result.events += 1
            fn(*args)
            if self._check_all:
                self._check_current_points()
            if until_converged and self._rp_moved and self.t_final is not None:
                self._rp_moved = False
                if self._converged():
                    return
        self.now = t_end

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
        rng = self.rng
        for nid in self.ids:
            node = self.nodes[nid]
            if self.rates["skew"] and rng.random() < self.rates["skew"]:
                node.skew = rng.uniform(0.5, 2.0)
            node.core = NodeCore(nid, node.incarnation)
            self.at(rng.randint(0, 20_000), self._declare, nid)
            self.at(rng.randint(0, self.cfg.tick_us), self._tick, nid, node.incarnation)
        for a, b in self.pairs:
            self.at(rng.randint(0, 5_000), self._connect, a, b)
        if self.cfg.workload:
            for nid in self.ids:
                for rank in self.spec.ranks_of(nid):
                    sched = RankSchedule(rank, self.cfg.period_us, self.domains, rng)
                    self._next_save(nid, sched)
                self.at(rng.randint(20_000, 40_000), self._retire_round, nid)
        self.at(FAULT_STEP, self._fault_step)
        if self.cfg.compare_marker:
            self.at(5_000, self._sample)

    def _declare(self, nid: str) -> None:
        self._persist(nid, Declare(self.spec), delay=self.rng.randint(100, 1_000))

    # -- workload ---------------------------------------------------------------

    def _next_save(self, nid: str, sched: RankSchedule) -> None:
        epoch, times = sched.next_epoch()
        for domain, t in times.items():
            if t < self.cfg.safety_us:
                self.at(t, self._save, nid, sched.rank, domain, epoch)
        first = min(times.values())
        if first < self.cfg.safety_us:
            self.at(first, self._schedule_more, nid, sched, epoch)

    def _schedule_more(self, nid: str, sched: RankSchedule, epoch: int) -> None:
        if sched.epoch == epoch:
            self._next_save(nid, sched)

    def _save(self, nid: str, rank: int, domain: str, epoch: int) -> None:
        if self.phase != "safety":
            return
        self._persist(nid, Commit(STREAM, rank, domain, epoch), delay=self.rng.randint(100, 2_000))

    def _retire_round(self, nid: str) -> None:
        if self.phase != "safety":
            return
        self.at(self.now + self.rng.randint(20_000, 60_000), self._retire_round, nid)
        node = self.nodes[nid]
        core = node.core
        if core is None or node.paused_until > self.now or STREAM not in core.streams():
            return
        safe = core.safe_to_delete(STREAM)
        if not safe:
            return
        high_water = {m: self._durable_high_water(m) for m in self.ids}
        frozen = {m: self._open_frozen(m) for m in self.ids}
        for rank in self.spec.ranks_of(nid):
            for d in self.domains:
                key = (rank, d.name)
                doomed = sorted(e for e in self.truth.available[key] if e in safe)
                for e in doomed:
                    self.truth.check_retire(nid, e, high_water, frozen)
                    self.truth.available[key].discard(e)
                    self.truth.retired[key].add(e)
                    self.truth.touch()
                    self.trace(f"retire {nid} r{rank} {d.name} {e}")
                    self._persist(
                        nid, Retire(STREAM, rank, d.name, e), self.rng.randint(100, 2_000)
                    )

    def _durable_high_water(self, nid: str) -> int | None:
        return self.nodes[nid].high_water

    def _open_frozen(self, nid: str) -> list[IntervalSet]:
        """Frozen sets of ``nid``'s generations that no newer resolved one closed."""
        closed = self.closed_below.get(nid, 0)
        return [
            f.epochs
            for f in self.nodes[nid].durable
            if isinstance(f, Freeze) and f.generation >= closed
        ]

    # -- durability ---------------------------------------------------------------

    def _persist(self, nid: str, fact: Fact, delay: int) -> None:
        node = self.nodes[nid]
        if node.core is None:
            return  # the daemon is down: the rank gets no ack
        if node.paused_until > self.now:
            self.outstanding += 1
            self.at(node.paused_until, self._persist_later, nid, fact, delay)
            return
        try:
            node.core.check(fact)
        except Exception as exc:  # typed refusals are fine; they change nothing
            self.trace(f"refused {nid} {type(exc).__name__}")
            return
        self._enqueue(nid, fact, delay)

    def _enqueue(self, nid: str, fact: Fact, delay: int) -> None:
        # Group commit, as the daemon does it: facts that arrive while an fsync is
        # pending ride on it, and become durable (and visible) together.
        node = self.nodes[nid]
        self.outstanding += 1
        node.queue.append(fact)
        if not node.fsync_pending:
            node.fsync_pending = True
            self.at(self.now + delay, self._fsync, nid, node.incarnation)

    def _persist_later(self, nid: str, fact: Fact, delay: int) -> None:
        self.outstanding -= 1
        self._persist(nid, fact, delay)

    def _fsync(self, nid: str, incarnation: int) -> None:
        node = self.nodes[nid]
        if node.core is None or node.incarnation != incarnation:
            return  # crashed before fsync: lost, never acknowledged (see _crash)
        batch, node.queue = node.queue, []
        node.fsync_pending = False
        self.outstanding -= len(batch)
        for fact in batch:
            self._durable(nid, fact)
        self._after_change(nid)

    def _durable(self, nid: str, fact: Fact) -> None:
        node = self.nodes[nid]
        assert node.core is not None
        try:
            node.core.check(fact)
        except Exception:
            return
        node.durable.append(fact)
        if isinstance(fact, Commit):
            key = (fact.rank, fact.domain)
            self.truth.ever[key].add(fact.epoch)
            self.truth.touch()
            if fact.epoch not in self.truth.retired[key]:
                self.truth.available[key].add(fact.epoch)
            if fact.epoch == self.final_epoch:
                self.final_acks += 1
                if self.final_acks == self._final_needed:
                    # Nothing changes the truth from here on: the target is fixed.
                    self.t_final = self.now
                    self._bytes_at_final = self.result.bytes
                    self._want = self.expected_restore_point()
                    self._rp_moved = True
        self.trace(f"durable {nid} {type(fact).__name__} {getattr(fact, 'epoch', '')}")
        node.core.apply(fact)

    def _after_change(self, nid: str) -> None:
        node = self.nodes[nid]
        core = node.core
        if core is None:
            return
        if core.pending_facts:
            node.durable.extend(core.pending_facts)  # the contract: durable before sends
            for fact in core.pending_facts:
                if isinstance(fact, HighWater) and (
                    node.high_water is None or fact.epoch > node.high_water
                ):
                    node.high_water = fact.epoch
            core.pending_facts.clear()
        events, core.events = core.events, []
        for ev in events:
            if isinstance(ev, RestorePointChanged):
                self._rp_moved = True
                self.trace(f"rp {nid} {ev.old}->{ev.new}{' rollback' if ev.rollback else ''}")
                self.truth.check_restore_point(nid, ev.new, ev.rollback)
            elif isinstance(ev, GenerationResolved):
                self.trace(f"gen {nid} g{ev.generation}={ev.restore_point}")
                self.truth.check_generation(nid, ev.generation, ev.restore_point)
                if ev.generation > self.closed_below.get(nid, 0):
                    self.closed_below[nid] = ev.generation
        # Other links only have something new to say when the view changed.
        if core.view.seq == node.polled_seq:
            return
        node.polled_seq = core.view.seq
        for peer in self.neighbours[nid]:
            conn = self.conns.get(_key(nid, peer))
            if conn is not None and conn.alive:
                conn.links[nid].poll()
                self._flush(conn, nid)

    # -- network ------------------------------------------------------------------

    def _connect(self, a: str, b: str) -> None:
        key = _key(a, b)
        if key in self.conns and self.conns[key].alive:
            return
        na, nb = self.nodes[a], self.nodes[b]
        if (
            na.core is None
            or nb.core is None
            or (a, b) in self.blocked
            or (b, a) in self.blocked
            or na.paused_until > self.now
        ):
            back = min(na.backoff.get(b, 10_000) * 2, 160_000)
            na.backoff[b] = back
            if na.core is not None:
                self.at(self.now + back // 2 + self.rng.randint(0, back // 2), self._connect, a, b)
            return
        na.backoff[b] = 10_000
        conn = _Conn(self, a, b)
        self.conns[key] = conn
        self.trace(f"connect {a} {b}")
        conn.links[a].start()
        conn.links[b].start()
        self._flush(conn, a)
        self._flush(conn, b)

    def _flush(self, conn: _Conn, side: str) -> None:
        link = conn.links[side]
        data = link.data_to_send()
        dst = conn.other(side)
        if data and conn.alive:
            lat = self.cfg.latency_us
            if self.phase == "safety":
                lat += self.rng.randint(0, self.cfg.latency_us)
                if conn.slow_until > self.now:
                    lat *= conn.slow_factor
            t = max(self.now + lat, conn.last_delivery[dst] + 1)
            conn.last_delivery[dst] = t
            conn.inflight[dst].append((t, data))
            self.at(t, self._deliver, conn, dst, conn.timing[dst])
        self._drain_events(conn, side)

    def _drain_events(self, conn: _Conn, side: str) -> None:
        link = conn.links[side]
        while (ev := link.next_event()) is not None:
            if isinstance(ev, RecordsMerged):
                for rec in ev.records:
                    if len(self.archive) < 2_000:
                        self.archive.append(rec)
                    else:
                        self.archive[self.rng.randrange(2_000)] = rec
            elif isinstance(ev, Closed):
                if ev.error is not None and self.phase != "_":
                    raise InvariantViolation(
                        "protocol", f"{side} closed its link to {conn.other(side)}: {ev.error}"
                    )
                self._teardown(conn, f"{side}: {ev.reason}")
        if conn.alive and conn.established_at is None:
            la, lb = conn.links[conn.a], conn.links[conn.b]
            if la.peer is not None and lb.peer is not None:
                conn.established_at = self.now

    def _deliver(self, conn: _Conn, dst: str, timing: int) -> None:
        if not conn.alive or not conn.inflight[dst] or timing != conn.timing[dst]:
            return
        node = self.nodes[dst]
        src = conn.other(dst)
        if node.paused_until > self.now or (src, dst) in self.blocked:
            # Held back (TCP keeps order): everything behind it waits too.
            # Look again soon: a heal or the liveness phase may release it early.
            self.at(self.now + 1_000, self._deliver, conn, dst, timing)
            return
        _, data = conn.inflight[dst].popleft()
        self.result.bytes += len(data)
        self.trace(f"deliver {src}->{dst} {len(data)}")
        link = conn.links[dst]
        frames_before = link.frames_received
        try:
            link.receive_data(data)
            self.result.messages += link.frames_received - frames_before
        except ProtocolError as err:
            raise InvariantViolation(
                "protocol", f"{dst} rejected bytes from {src}: {err}"
            ) from None
        self._flush(conn, dst)
        if conn.alive:
            self._after_change(dst)

    def _teardown(self, conn: _Conn, why: str) -> None:
        if not conn.alive:
            return
        conn.alive = False
        self.trace(f"teardown {conn.a} {conn.b} ({why})")
        for side in (conn.a, conn.b):
            link = conn.links[side]
            if not link.closed:
                link.receive_data(b"")
            while link.next_event() is not None:
                pass
        self.at(self.now + self.rng.randint(5_000, 20_000), self._connect, conn.a, conn.b)

    def _tick(self, nid: str, incarnation: int) -> None:
        node = self.nodes[nid]
        if node.core is None or node.incarnation != incarnation:
            return
        interval = int(self.cfg.tick_us * node.skew)
        self.at(self.now + interval, self._tick, nid, incarnation)
        if node.paused_until > self.now:
            return
        for peer in self.neighbours[nid]:
            conn = self.conns.get(_key(nid, peer))
            if conn is not None and conn.alive:
                conn.links[nid].on_timer()
                self._flush(conn, nid)

    # -- faults -------------------------------------------------------------------

    def _fault_step(self) -> None:
        if self.phase != "safety":
            return
        self.at(self.now + FAULT_STEP, self._fault_step)
        if self.blocked and self.now >= self.blocked_until:
            self.blocked.clear()
            self.trace("heal partition")
        rng = self.rng
        for fault in FAULTS:
            rate = self.rates[fault]
            if rate and fault != "skew" and rng.random() < rate:
                getattr(self, f"_fault_{fault}")()
                self.result.fault_counts[fault] = self.result.fault_counts.get(fault, 0) + 1

    def _live_conns(self) -> list[_Conn]:
        return [c for _, c in sorted(self.conns.items()) if c.alive]

    def _fault_reset(self) -> None:
        conns = self._live_conns()
        if not conns:
            return
        conn = self.rng.choice(conns)
        # Mid-frame: one side receives a prefix of a frame in flight, then EOF.
        for side in (conn.a, conn.b):
            if conn.inflight[side]:
                _, data = conn.inflight[side][0]
                cut = self.rng.randint(1, max(1, len(data) - 1))
                conn.inflight[side].clear()
                if not conn.links[side].closed and self.nodes[side].core is not None:
                    try:
                        conn.links[side].receive_data(data[:cut])
                    except ProtocolError as err:
                        raise InvariantViolation("protocol", f"prefix rejected: {err}") from None
                break
        self.trace(f"fault reset {conn.a} {conn.b}")
        self._teardown(conn, "reset")

    def _fault_delay(self) -> None:
        conns = self._live_conns()
        if conns:
            conn = self.rng.choice(conns)
            conn.slow_until = self.now + self.rng.randint(10_000, 80_000)
            conn.slow_factor = self.rng.randint(3, 20)
            self.trace(f"fault delay {conn.a} {conn.b} x{conn.slow_factor}")

    def _fault_clog(self) -> None:
        conns = self._live_conns()
        if conns:
            conn = self.rng.choice(conns)
            conn.slow_until = self.now + self.rng.randint(50_000, 200_000)
            conn.slow_factor = self.rng.randint(200, 1_000)
            self.trace(f"fault clog {conn.a} {conn.b}")

    def _fault_partition(self) -> None:
        rng = self.rng
        ids = self.ids
        kind = rng.choice(["symmetric", "one-way", "majorities-ring", "bridge"])
        blocked: set[tuple[str, str]] = set()
        shuffled = ids[:]
        rng.shuffle(shuffled)
        cut = rng.randint(1, max(1, len(ids) - 1))
        left, right = shuffled[:cut], shuffled[cut:]
        if kind in ("symmetric", "one-way"):
            for a in left:
                for b in right:
                    blocked.add((a, b))
                    if kind == "symmetric":
                        blocked.add((b, a))
        elif kind == "majorities-ring":
            n = len(ids)
            reach = n // 2
            for i, a in enumerate(shuffled):
                for j, b in enumerate(shuffled):
                    if a != b and min((i - j) % n, (j - i) % n) > reach // 2:
                        blocked.add((a, b))
        else:  # bridge: two halves that only the bridge node connects
            bridge = right[0] if right else left[0]
            for a in left:
                for b in right:
                    if bridge not in (a, b):
                        blocked.add((a, b))
                        blocked.add((b, a))
        self.blocked = blocked
        self.blocked_until = self.now + rng.randint(30_000, 150_000)
        self.trace(f"fault partition {kind} {len(blocked)}")

    def _fault_crash(self) -> None:
        alive = [i for i in self.ids if self.nodes[i].core is not None]
        if not alive:
            return
        nid = self.rng.choice(alive)
        self._crash(nid)
        self.at(self.now + self.rng.randint(20_000, 120_000), self._restart, nid)

    def _crash(self, nid: str) -> None:
        node = self.nodes[nid]
        node.crashes += 1
        if node.crashes % 2 == 0 and node.core is not None:
            # Every other crash finds the log compacted, as the daemon compacts it
            # when it grows: the restart replays the compacted facts, so the oracle
            # checks compaction under every fault too. (No random draw: seeds keep
            # their schedules.)
            node.durable = node.core.compacted_facts()
            self.trace(f"compact {nid} {len(node.durable)} facts")
        node.core = None
        self.outstanding -= len(node.queue)
        node.queue = []
        node.fsync_pending = False
        self.trace(f"fault crash {nid}")
        if self.cfg.compare_marker:
            self._sample(reschedule=False)
        for peer in self.neighbours[nid]:
            conn = self.conns.get(_key(nid, peer))
            if conn is not None and conn.alive:
                conn.alive = False
                other = conn.links[peer]
                if not other.closed:
                    other.receive_data(b"")
                while other.next_event() is not None:
                    pass
                self.at(self.now + self.rng.randint(5_000, 20_000), self._connect, conn.a, conn.b)

    def _restart(self, nid: str) -> None:
        node = self.nodes[nid]
        if node.core is not None:
            return
        node.incarnation += 1
        core = NodeCore(nid, node.incarnation)
        core.replay(node.durable)
        core.pending_facts.clear()
        core.events.clear()
        node.core = core
        node.polled_seq = -1
        node.paused_until = 0
        self.trace(f"restart {nid} inc {node.incarnation}")
        if not any(isinstance(f, Declare) for f in node.durable):
            self._declare(nid)  # the job declares again when it reconnects
        self.at(self.now + self.rng.randint(0, self.cfg.tick_us), self._tick, nid, node.incarnation)
        for peer in self.neighbours[nid]:
            a, b = _key(nid, peer)
            self.at(self.now + self.rng.randint(0, 5_000), self._connect, a, b)

    def _fault_pause(self) -> None:
        alive = [i for i in self.ids if self.nodes[i].core is not None]
        if alive:
            nid = self.rng.choice(alive)
            self.nodes[nid].paused_until = self.now + self.rng.randint(5_000, 150_000)
            self.trace(f"fault pause {nid}")

    def _fault_replay(self) -> None:
        alive = [i for i in self.ids if self.nodes[i].core is not None]
        if not alive or not self.archive:
            return
        nid = self.rng.choice(alive)
        recs = [self.rng.choice(self.archive) for _ in range(self.rng.randint(1, 5))]
        self.trace(f"fault replay {nid} {len(recs)}")
        core = self.nodes[nid].core
        assert core is not None
        core.receive(recs)
        self._after_change(nid)

    def _fault_retract(self) -> None:
        rng = self.rng
        nid = rng.choice(self.ids)
        if self.nodes[nid].core is None:
            return
        rank = rng.choice(self.spec.ranks_of(nid))
        domain = rng.choice(self.spec.policy.domains)
        avail = sorted(self.truth.available[(rank, domain)])
        if not avail:
            return
        epoch = avail[-1] if rng.random() < 0.5 else rng.choice(avail)
        self.truth.available[(rank, domain)].discard(epoch)
        self.truth.retractions += 1
        self.trace(f"fault retract {nid} r{rank} {domain} {epoch}")
        self._persist(nid, Retract(STREAM, rank, domain, epoch), rng.randint(100, 2_000))
        if rng.random() < 0.3:
            self._recovery()

    def _recovery(self) -> None:
        """The job restarts: every member asks for a new recovery generation."""
        self.generation += 1
        for nid in self.ids:
            self.at(self.now + self.rng.randint(0, 30_000), self._freeze, nid, self.generation)

    def _freeze(self, nid: str, generation: int) -> None:
        node = self.nodes[nid]
        if node.core is None:
            self.at(self.now + 20_000, self._freeze, nid, generation)
            return
        try:
            fact = node.core.freeze_fact(STREAM, generation)
        except Exception as exc:
            self.trace(f"freeze refused {nid} g{generation} {type(exc).__name__}")
            return
        if fact is not None:
            node.durable.append(fact)
            node.core.apply(fact)
            self.trace(f"freeze {nid} g{generation} {fact.epochs}")
            self._after_change(nid)

    # -- marker baseline ----------------------------------------------------------

    def _sample(self, reschedule: bool = True) -> None:
        if self.phase != "safety":
            return
        if reschedule:
            self.at(self.now + 5_000, self._sample)
        rank0 = self.spec.members[0][1][0]
        domains = self.spec.policy.domains
        saved = [self.truth.ever[(rank0, d)] for d in domains]
        if not all(saved):
            return
        marker = min(max(s) for s in saved)
        self.result.marker_samples += 1
        # The same yardstick as S1 for convergenced: committed by every rank of
        # every member and never deleted (losses count against neither).
        if not self.truth.valid(marker):
            self.result.marker_invalid += 1
        for nid in self.ids:
            core = self.nodes[nid].core
            if core is not None and STREAM in core.streams():
                rp = core.restore_point(STREAM)
                if rp is not None and not self.truth.valid(rp):
                    self.result.convergence_invalid += 1

    # -- liveness -----------------------------------------------------------------

    def _begin_liveness(self) -> None:
        self.phase = "liveness"
        self.trace("liveness phase")
        self.blocked.clear()
        for nid in self.ids:
            node = self.nodes[nid]
            node.paused_until = 0
            node.skew = 1.0
            if node.core is None:
                self._restart(nid)
        for _, conn in sorted(self.conns.items()):
            conn.slow_until = 0
            if conn.alive:
                # Healing a clogged path flushes what it held: bytes still in flight
                # arrive now, in order, instead of at their clogged delivery times.
                for dst in (conn.a, conn.b):
                    conn.timing[dst] += 1
                    when = self.now
                    for i, (_, data) in enumerate(conn.inflight[dst]):
                        when = self.now + self.cfg.latency_us + i
                        conn.inflight[dst][i] = (when, data)
                        self.at(when, self._deliver, conn, dst, conn.timing[dst])
                    conn.last_delivery[dst] = when
        for a, b in self.pairs:
            self.at(self.now, self._connect, a, b)
        self.at(self.now + 1_000, self._await_mesh)

    def _await_mesh(self) -> None:
        up = all(
            (c := self.conns.get(_key(a, b))) is not None and c.alive and c.established_at
            for a, b in self.pairs
        )
        declared = all(
            (n.core is not None and STREAM in n.core.streams()) for n in self.nodes.values()
        )
        if not (up and declared and self.outstanding == 0):
            self.at(self.now + 1_000, self._await_mesh)
            return
        top = max((max(s) for s in self.truth.ever.values() if s), default=0)
        self.final_epoch = top + 1
        self._final_needed = len(self.ids) * self.cfg.ranks_per_node * len(self.domains)
        self.trace(f"final commit {self.final_epoch}")
        for nid in self.ids:
            for rank in self.spec.ranks_of(nid):
                for d in self.domains:
                    fact = Commit(STREAM, rank, d.name, self.final_epoch)
                    self.at(self.now + 1, self._persist_final, nid, fact)

    def _persist_final(self, nid: str, fact: Commit) -> None:
        assert self.nodes[nid].core is not None
        self._enqueue(nid, fact, 100)

    def expected_restore_point(self) -> int | None:
        """S5: the newest epoch of the true convergence interval at or above the floor."""
        ci = self.truth.convergence()
        hws = [h for h in (self._durable_high_water(m) for m in self.ids) if h is not None]
        floor = max(hws) - self.spec.retention if hws else 0
        return ci.at_least(max(floor, 0)).max()

    def _converged(self) -> bool:
        if self.t_final is None:
            return False
        want = self._want
        for nid in self.ids:
            core = self.nodes[nid].core
            if core is None or core.restore_point(STREAM) != want:
                return False
        r = self.result
        r.converged = True
        r.restore_point = want
        rtt = 2 * self.cfg.latency_us
        r.rounds_to_converge = max(1, math.ceil((self.now - self.t_final) / rtt))
        bound = liveness_bound(len(self.ids))
        if r.rounds_to_converge > bound:
            raise InvariantViolation(
                "S5", f"converged after {r.rounds_to_converge} handshake rounds, bound {bound}"
            )
        spent = r.bytes - self._bytes_at_final
        r.bytes_per_node_per_round = spent / len(self.ids) / r.rounds_to_converge
        return True

    def _liveness_failure(self) -> None:
        want = self.expected_restore_point()
        got = {
            nid: (n.core.restore_point(STREAM) if n.core and STREAM in n.core.streams() else "-")
            for nid, n in self.nodes.items()
        }
        raise InvariantViolation("S5", f"no convergence on {want} after healing: {got}")


def liveness_bound(nodes: int) -> int:
    """S5's bound on handshake rounds from the last commit to agreement after healing.

    Two phases each cross the overlay's diameter (at most ceil(log2 N) hops), so
    ``2 * ceil(log2 N)``; the slack of 8 covers what a healed cluster still carries
    from the faulty phase (a token parked mid-exchange, a link's nudge already
    spent). Fault-free runs are held to the tight bound by the tests.
    """
    return 2 * max(1, math.ceil(math.log2(max(nodes, 2)))) + 8


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)
