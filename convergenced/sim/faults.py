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
  later from its log, and its ranks commit again the copies they find;
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
  its checkpoints (sometimes without the incarnation floor kept beside its key;
  sometimes without its node-local checkpoints, the disk that held them gone too),
  and its ranks commit again what they still find;
* ``undeclare``: the job on one node ends and undeclares the stream; a job of the
  same name starts there 5-100 ms later and declares it again, finding its
  checkpoints on disk half the time (it commits them again) and nothing otherwise.

* ``upgrade``: a node reports another driver version, or another set of versions it
  accepts beside it (`versions`).

Four faults change the job's membership (`MEMBERSHIP_FAULTS`): each relaunches the
job with a new member map, as `launches` describes (one rank asks
``next_generation``, every rank declares the new map with ``membership`` = that
generation, the ranks that moved adopt the copies they find, every rank asks for the
generation). The cluster then has `world.SPARES` pre-provisioned spare nodes from the
start (peers and trust set from the start; a host gone for good is taken out of the
others' configuration), which hold no stream until the job moves ranks to
them; a run never has more nodes than that. With every fault enabled, a seed turns
these four on with the chance `world.MEMBERSHIP_SHARE`; a list naming them turns them
on in every seed. With ``SimConfig.churn`` (``--churn K``) they fire at K fixed times
instead of at drawn rates (`churn_plan`), so that a scale run makes as many changes at
every N.

* ``replace``: a member's host dies for good, its disk with it; a spare that never
  held a stream (a new node id, an empty disk) takes over every rank it hosted, and
  those ranks adopt their shared copies there;
* ``shrink``: the job relaunches on one node fewer (never below two); the removed
  member's ranks move to the remaining members, which adopt their shared copies; the
  removed node keeps running with the older spec, holding its node-local copies;
* ``grow``: the job relaunches on one node more (a spare, or a node it left before):
  it takes one rank each from some of the members hosting more than one;
* ``leave``: a member leaves in the middle of a generation: the job is relaunched,
  and once some member froze the launch's generation, one that did not (if any) goes
  away (half the time its host dies for good) and the job relaunches without it, its
  ranks moved to the remaining members (never below two).
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.facts import Fact, Retract
from convergenced.core.records import Record
from convergenced.core.spec import StreamSpec
from convergenced.sim.launches import Launches
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM, Network
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.placement import Placement
from convergenced.sim.versions import SimVersions

FAULTS = (
    "reset", "delay", "clog", "partition", "crash", "pause", "skew", "replay", "retract",
    "lose_state", "undeclare", "relaunch", "replace", "shrink", "grow", "leave", "upgrade",
)  # fmt: skip
"""Every fault the simulator can inject (``--faults all``)."""
MEMBERSHIP_FAULTS = frozenset({"replace", "shrink", "grow", "leave"})
"""The faults that change the job's member map (the cluster then has spares)."""

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
    "replace": (0.0, 0.05),
    "shrink": (0.0, 0.05),
    "grow": (0.0, 0.05),
    "leave": (0.0, 0.05),
}
"""Per fault, the range its rate is drawn from: chance per fault step (``upgrade``
draws its own: `versions`)."""
FAULT_STEP = 10_000
LOCAL_TOO = 0.4
"""How often ``lose_state`` takes the node-local checkpoints too (when there are any)."""
MIN_MEMBERS = 2
"""``shrink`` and ``leave`` never take the job below this many members."""


def churn_plan(enabled: frozenset[str], count: int) -> list[str]:
    """The membership changes of a run with ``SimConfig.churn = count``, in order: the
    enabled membership faults in the order of `FAULTS` (replace, shrink, grow, leave),
    cycled, so each kind fires as often as the others whatever the seed (a kind's drawn
    rate would make one seed all grows and another all leaves)."""
    kinds = [f for f in FAULTS if f in MEMBERSHIP_FAULTS and f in enabled]
    return [kinds[i % len(kinds)] for i in range(count)] if kinds else []


def churn_spares(plan: list[str]) -> int:
    """Spares a churn plan needs so that no change in it is skipped for want of a node:
    each ``replace`` takes a spare that never hosted ranks, and a ``grow`` may have
    taken one before it (it draws from every node outside the job)."""
    return sum(1 for kind in plan if kind in ("replace", "grow"))


LEAVE_POLL_US = 2_000
LEAVE_WAIT_US = 60_000
"""How long ``leave`` waits for a member to freeze the launch's generation."""


class FaultTarget(Protocol):
    """What the faults act on: the world of one run."""

    loop: EventLoop
    net: Network
    nodes: dict[str, SimNode]
    ids: list[str]
    spec: StreamSpec
    placement: Placement
    truth: Truth
    archive: list[Record]
    gone: set[str]
    launches: Launches
    phase: str
    versions: SimVersions

    def crash(self, nid: str) -> None:
        """Kill ``nid``'s daemon."""

    def restart(self, nid: str) -> None:
        """Start ``nid``'s daemon again from its log."""

    def would_forget_everything(self, nid: str) -> bool:
        """Whether no member would remember the stream if ``nid`` lost its state."""

    def lose_state(self, nid: str, *, floor_too: bool = False, local_too: bool = False) -> None:
        """Kill ``nid``'s daemon and lose its state directory (and, with
        ``floor_too``, the incarnation floor beside its identity key; with
        ``local_too``, its node-local checkpoints)."""

    def undeclare(self, nid: str, *, keep_checkpoints: bool) -> None:
        """The job on ``nid`` undeclares the stream; the next one declares it again."""

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A rank of ``nid`` submits ``fact`` to its daemon."""

    def after_change(self, nid: str) -> None:
        """``nid``'s core changed: let its links speak."""

    def recovery(self) -> None:
        """The job restarts: every member asks for a new recovery generation."""

    def gone_for_good(self, nid: str) -> None:
        """``nid``'s host dies and never comes back, with its disk."""

    def move_ranks(self, placement: Placement, why: str) -> int:
        """The job relaunches with its ranks on ``placement``; returns the launch."""


class FaultInjector:
    """Draws the per-seed rates and fires the faults of each fault step."""

    def __init__(self, world: FaultTarget, enabled: frozenset[str], churn: int = 0) -> None:
        self.world = world
        rng = world.loop.rng
        self.rates = {f: (rng.uniform(*RATE_RANGES[f]) if f in enabled else 0.0)
                      for f in RATE_RANGES}  # fmt: skip
        self.counts: dict[str, int] = {}
        self.hosted = set(world.spec.member_ids)
        """Nodes that ever hosted ranks (a spare for ``replace`` never did)."""
        self.plan = churn_plan(enabled, churn)
        """The membership changes made at fixed times (`schedule_churn`); their drawn
        rates are then unused (the draws stay, so the other faults' rates are those
        of the same seed without churn)."""
        if self.plan:
            for fault in MEMBERSHIP_FAULTS:
                self.rates[fault] = 0.0
        self.joined = 0
        self.left = 0
        """Nodes the job's member map gained and lost, over every change: what a
        membership fault really did (a ``leave`` cut short by a relaunch or by the
        end of the faults moves no one)."""
        self.skipped = 0
        """Planned changes that found nothing to do (`schedule_churn`)."""

    def schedule_churn(self, until_us: int) -> None:
        """Schedule the planned membership changes, evenly spaced over the faulty phase
        (the k-th of n at k/(n + 1) of it: the first after the links formed, the last
        with time left for a ``leave`` to wait for a frozen generation)."""
        loop, n = self.world.loop, len(self.plan)
        for k, kind in enumerate(self.plan, start=1):
            loop.at(until_us * k // (n + 1), self._planned, kind)

    def _planned(self, kind: str) -> None:
        if self.world.phase != "safety":
            return
        if getattr(self, f"_{kind}")() is False:
            self.skipped += 1
            self.world.loop.trace(f"fault {kind} skipped: nothing to do")
        else:
            self.counts[kind] = self.counts.get(kind, 0) + 1

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
        for fault in RATE_RANGES:
            rate = self.rates[fault]
            fired = rate and fault != "skew" and loop.rng.random() < rate
            if fired and getattr(self, f"_{fault}")() is not False:  # False: nothing to do
                self.counts[fault] = self.counts.get(fault, 0) + 1
        # Rolled on a random stream of its own: seeds without it run as they did.
        if w.versions.upgrade():
            self.counts["upgrade"] = self.counts.get("upgrade", 0) + 1

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
            # life from what its peers tell it. Sometimes the node-local tiers go too
            # (the disk that held them): only the shared copies are left to commit.
            rng = w.loop.rng
            floor_too = rng.random() < 0.3
            local_too = rng.random() < LOCAL_TOO and not set(w.spec.policy.domains) <= set(
                w.spec.shared
            )
            w.lose_state(nid, floor_too=floor_too, local_too=local_too)
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
            node = self.world.nodes[nid]
            # A second stall of a stalled daemon never ends the first one early: what
            # waited for the first (its clients' requests) would be taken after what
            # arrived since, in an order no client could see (seed 442411).
            node.paused_until = max(node.paused_until, loop.now + loop.rng.randint(5_000, 150_000))
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
        nid = rng.choice(w.spec.member_ids)
        core = w.nodes[nid].core
        if core is None or STREAM not in core.streams():
            return
        ranks = core.spec(STREAM).ranks_of(nid)
        if not ranks:
            return
        rank = rng.choice(ranks)
        domain = rng.choice(w.spec.policy.domains)
        avail = sorted(w.truth.storage.found(nid, rank, domain))
        if not avail:
            return
        epoch = avail[-1] if rng.random() < 0.5 else rng.choice(avail)
        w.truth.storage.lose(nid, rank, domain, epoch)
        w.truth.retractions += 1
        w.loop.trace(f"fault retract {nid} r{rank} {domain} {epoch}")
        w.submit(nid, Retract(STREAM, rank, domain, epoch))
        if rng.random() < 0.3:
            w.recovery()

    def _undeclare(self) -> None:
        w = self.world
        rng = w.loop.rng
        w.undeclare(rng.choice(w.spec.member_ids), keep_checkpoints=rng.random() < 0.5)

    # -- membership changes ----------------------------------------------------------

    def _pool(self, *, fresh: bool) -> list[str]:
        """Nodes the job could move ranks to: outside it and not gone (with
        ``fresh``, only spares that never hosted ranks)."""
        w = self.world
        members = set(w.placement.node_ids())
        return [n for n in w.ids if n not in members and n not in w.gone
                and not (fresh and n in self.hosted)]  # fmt: skip

    def _move(self, placement: Placement, why: str) -> int:
        before, after = set(self.world.placement.node_ids()), set(placement.node_ids())
        self.joined += len(after - before)
        self.left += len(before - after)
        self.hosted.update(after)
        return self.world.move_ranks(placement, why)

    def _replace(self) -> bool:
        w = self.world
        spares = self._pool(fresh=True)
        if not spares:
            return False  # every spare is in use
        rng = w.loop.rng
        dead = rng.choice(w.placement.node_ids())
        spare = rng.choice(spares)
        w.gone_for_good(dead)
        self._move(w.placement.replaced(dead, spare), f"replace {dead} by {spare}")
        return True

    def _shrink(self) -> bool:
        w = self.world
        members = w.placement.node_ids()
        if len(members) <= MIN_MEMBERS:
            return False
        rng = w.loop.rng
        out = rng.choice(members)
        self._move(w.placement.shrunk(out, rng), f"shrink without {out}")
        return True

    def _grow(self) -> bool:
        w = self.world
        pool = self._pool(fresh=False)
        rng = w.loop.rng
        new = rng.choice(pool) if pool else None
        placement = w.placement.grown(new, rng) if new is not None else None
        if new is None or placement is None:
            return False  # no node to grow onto, or no member to take a rank from
        self._move(placement, f"grow onto {new}")
        return True

    def _leave(self) -> bool:
        w = self.world
        if len(w.placement.node_ids()) <= MIN_MEMBERS:
            return False
        w.loop.trace("fault leave: relaunch")
        launch = w.launches.relaunch()
        deadline = w.loop.now + LEAVE_WAIT_US
        w.loop.after(LEAVE_POLL_US, self._leave_later, launch, deadline)
        return True

    def _leave_later(self, launch: int, deadline: int) -> None:
        """Once some member froze the launch's generation, one that did not leaves."""
        w = self.world
        loop = w.loop
        if w.launches.launch != launch or w.phase != "safety":
            return  # relaunched meanwhile, or the faults stopped
        members = w.placement.node_ids()
        if len(members) <= MIN_MEMBERS:
            return
        g = w.launches.generation_of.get(launch)
        froze = [m for m in members if g is not None and g in w.nodes[m].durable_frozen]
        if not froze and loop.now < deadline:
            loop.after(LEAVE_POLL_US, self._leave_later, launch, deadline)
            return
        rng = loop.rng
        out = rng.choice([m for m in members if m not in froze] or members)
        dies = rng.random() < 0.5
        if dies:
            w.gone_for_good(out)
        self._move(w.placement.shrunk(out, rng), f"leave {out}{' dies' if dies else ''} g{g}")
