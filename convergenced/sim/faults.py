"""The faults the simulator injects, and how often.

Faults follow swarm testing (as in FoundationDB's simulator and TigerBeetle's
VOPR): each enabled fault gets a rate drawn per seed, so some seeds hammer one
fault and barely touch another. Every fault step (10 ms of virtual time) each fault
fires with its rate. ``skew`` is drawn once per node at the start (its timer runs
fast or slow); every other fault is an event:

* ``reset``: a connection dies mid-frame (one side gets a prefix, then EOF);
* ``delay`` / ``clog``: a connection's latency is multiplied for a while;
* ``partition``: some directed pairs cannot talk (symmetric, one-way, a ring of
  majorities, or two halves joined by one bridge node);
* ``crash``: a daemon dies (its unsynced facts and held bytes with it) and restarts
  later from its log;
* ``pause``: a daemon stops processing for a while (a GC pause, a stopped VM);
* ``replay``: old records, from anywhere, arrive again;
* ``retract``: a rank loses an epoch it had committed (and sometimes the job
  restarts into a new recovery generation);
* ``relaunch``: the job is relaunched (preempted, requeued, rerun) with its
  launcher's counter back at 0, sometimes twice in quick succession: one rank, on
  any member, asks its daemon for a new generation and hands it to the others; the
  ranks of the launch before die, one already asking may still reach its daemon;
* ``lose_state``: a daemon dies and its state directory is lost (a replaced disk, a
  rescheduled pod): it comes back later from an empty log, with its identity and
  its checkpoints (sometimes without the incarnation floor kept beside its key),
  and its ranks commit again what they still hold;
* ``undeclare``: the job on one node ends and undeclares the stream; a job of the
  same name starts there 5-100 ms later and declares it again, finding its
  checkpoints on disk half the time (it commits them again) and nothing otherwise.
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.facts import Fact, Retract
from convergenced.core.records import Record
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Network
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth

FAULTS = (
    "reset", "delay", "clog", "partition", "crash", "pause", "skew", "replay", "retract",
    "lose_state", "undeclare", "relaunch",
)  # fmt: skip
"""Every fault the simulator can inject (``--faults all``)."""

RATE_RANGES: dict[str, tuple[float, float]] = {
    "reset": (0.0, 0.25),
    "delay": (0.0, 0.3),
    "clog": (0.0, 0.1),
    "partition": (0.0, 0.08),
    "crash": (0.0, 0.08),
    "pause": (0.0, 0.1),
    "skew": (0.0, 1.0),
    "replay": (0.0, 0.5),
    "retract": (0.0, 0.15),
    "lose_state": (0.0, 0.04),
    "undeclare": (0.0, 0.03),
    "relaunch": (0.0, 0.06),
}
"""Per fault, the range its rate is drawn from: chance per fault step."""
FAULT_STEP = 10_000


class FaultTarget(Protocol):
    """What the faults act on: the world of one run."""

    loop: EventLoop
    net: Network
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    truth: Truth
    archive: list[Record]

    def crash(self, nid: str) -> None:
        """Kill ``nid``'s daemon."""

    def restart(self, nid: str) -> None:
        """Start ``nid``'s daemon again from its log."""

    def would_forget_everything(self, nid: str) -> bool:
        """Whether no member would remember the stream if ``nid`` lost its state."""

    def lose_state(self, nid: str, *, floor_too: bool = False) -> None:
        """Kill ``nid``'s daemon and lose its state directory (and, with
        ``floor_too``, the incarnation floor beside its identity key)."""

    def undeclare(self, nid: str, *, keep_checkpoints: bool) -> None:
        """The job on ``nid`` undeclares the stream; the next one declares it again."""

    def submit(self, nid: str, fact: Fact) -> None:
        """A rank of ``nid`` submits ``fact`` to its daemon."""

    def after_change(self, nid: str) -> None:
        """``nid``'s core changed: let its links speak."""

    def recovery(self) -> None:
        """The job restarts: every member asks for a new recovery generation."""


class FaultInjector:
    """Draws the per-seed rates and fires the faults of each fault step."""

    def __init__(self, world: FaultTarget, enabled: frozenset[str]) -> None:
        self.world = world
        rng = world.loop.rng
        self.rates = {f: (rng.uniform(*RATE_RANGES[f]) if f in enabled else 0.0) for f in FAULTS}
        self.counts: dict[str, int] = {}

    def skew_clocks(self) -> None:
        """Give some nodes a timer that runs fast or slow (the ``skew`` fault)."""
        rng = self.world.loop.rng
        rate = self.rates["skew"]
        for nid in self.world.ids:
            if rate and rng.random() < rate:
                self.world.nodes[nid].skew = rng.uniform(0.5, 2.0)

    def step(self) -> None:
        """One fault step: heal an expired partition, then roll each fault."""
        w = self.world
        net, loop = w.net, w.loop
        if net.blocked and loop.now >= net.blocked_until:
            net.blocked.clear()
            loop.trace("heal partition")
        for fault in FAULTS:
            rate = self.rates[fault]
            if rate and fault != "skew" and loop.rng.random() < rate:
                getattr(self, f"_{fault}")()
                self.counts[fault] = self.counts.get(fault, 0) + 1

    # -- the faults ----------------------------------------------------------------

    def _reset(self) -> None:
        conns = self.world.net.live()
        if conns:
            self.world.net.deliver_prefix_and_reset(self.world.loop.rng.choice(conns))

    def _delay(self) -> None:
        self._slow(10_000, 80_000, 3, 20, "delay")

    def _clog(self) -> None:
        self._slow(50_000, 200_000, 200, 1_000, "clog")

    def _slow(self, lo: int, hi: int, f_lo: int, f_hi: int, name: str) -> None:
        loop = self.world.loop
        conns = self.world.net.live()
        if conns:
            conn = loop.rng.choice(conns)
            conn.slow_until = loop.now + loop.rng.randint(lo, hi)
            conn.slow_factor = loop.rng.randint(f_lo, f_hi)
            loop.trace(f"fault {name} {conn.a} {conn.b} x{conn.slow_factor}")

    def _partition(self) -> None:
        loop, ids = self.world.loop, self.world.ids
        rng = loop.rng
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
        net = self.world.net
        net.blocked = blocked
        net.blocked_until = loop.now + rng.randint(30_000, 150_000)
        loop.trace(f"fault partition {kind} {len(blocked)}")

    def _alive(self) -> list[str]:
        return [i for i in self.world.ids if self.world.nodes[i].up]

    def _crash(self) -> None:
        alive = self._alive()
        if alive:
            w = self.world
            nid = w.loop.rng.choice(alive)
            w.crash(nid)
            w.loop.after(w.loop.rng.randint(20_000, 120_000), w.restart, nid)

    def _lose_state(self) -> None:
        alive = self._alive()
        if alive:
            w = self.world
            nid = w.loop.rng.choice(alive)
            if w.would_forget_everything(nid):
                w.loop.trace(f"fault lose_state {nid} skipped: no other member remembers")
                return
            # Three times in ten the incarnation floor goes too (kept beside a key in
            # a volume that died with the pod): the node must rise above its lost
            # life from what its peers tell it.
            w.lose_state(nid, floor_too=w.loop.rng.random() < 0.3)
            w.loop.after(w.loop.rng.randint(20_000, 120_000), w.restart, nid)

    def _relaunch(self) -> None:
        w = self.world
        w.loop.trace("fault relaunch")
        w.recovery()
        if w.loop.rng.random() < 0.3:  # and again, before the first one got far
            w.loop.after(w.loop.rng.randint(0, 20_000), w.recovery)

    def _pause(self) -> None:
        alive = self._alive()
        if alive:
            loop = self.world.loop
            nid = loop.rng.choice(alive)
            self.world.nodes[nid].paused_until = loop.now + loop.rng.randint(5_000, 150_000)
            loop.trace(f"fault pause {nid}")

    def _replay(self) -> None:
        w = self.world
        alive = self._alive()
        if not alive or not w.archive:
            return
        rng = w.loop.rng
        nid = rng.choice(alive)
        recs = [rng.choice(w.archive) for _ in range(rng.randint(1, 5))]
        w.loop.trace(f"fault replay {nid} {len(recs)}")
        core = w.nodes[nid].core
        assert core is not None
        core.receive(recs)
        w.after_change(nid)

    def _retract(self) -> None:
        w = self.world
        rng = w.loop.rng
        nid = rng.choice(w.ids)
        if not w.nodes[nid].up:
            return
        rank = rng.choice(w.spec.ranks_of(nid))
        domain = rng.choice(w.spec.policy.domains)
        avail = sorted(w.truth.available[(rank, domain)])
        if not avail:
            return
        epoch = avail[-1] if rng.random() < 0.5 else rng.choice(avail)
        w.truth.available[(rank, domain)].discard(epoch)
        w.truth.retractions += 1
        w.loop.trace(f"fault retract {nid} r{rank} {domain} {epoch}")
        w.submit(nid, Retract(STREAM, rank, domain, epoch))
        if rng.random() < 0.3:
            w.recovery()

    def _undeclare(self) -> None:
        w = self.world
        rng = w.loop.rng
        w.undeclare(rng.choice(w.ids), keep_checkpoints=rng.random() < 0.5)
