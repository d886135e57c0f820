"""Rolling a driver out under faults: three strategies side by side (``--rollout``).

The job's nodes run driver version *old*. Early in the faulty phase each node
installs a build that still runs *old* but accepts *new* beside it (a staged
rollout's usual first step), each at its own moment: a node that is down then gets
it when it starts again. From `START_US` on, the nodes move to *new*, each by a
*drain*: the node's daemon and ranks stop (training on it is lost from its last
durable save), it is down for `DOWN_US`, and it comes back running *new*. The
strategies differ only in when a node is drained:

* ``naive``: a rolling update on a timer, one node every `NAIVE_EVERY_US`, as a
  maintenance script that waits for nothing;
* ``flip``: "atomic flip at time t": every node drains at `START_US`, by its own
  clock (skewed as the ``skew`` fault says), whatever it is doing;
* ``gated``: one node at a time, each only once the node's own daemon says the
  drain is safe (`core.drain`, as ``convergencectl gate NODE --version``: a restore
  point every member published, at least the node's newest epoch when it was asked,
  and every member of the job accepts *new* and acknowledged that), and the next
  only once the job acknowledged the node back on *new*.

Every run measures, against the ground truth (never a node's view):

* ``samples`` / ``incompatible``: every `SAMPLE_US` from `START_US` on, whether the
  job has members running a version another member does not accept;
* ``drains`` / ``unsafe_drains``: drains, and those where the node's newest epoch
  was not restorable by the whole job at that moment (it had saved work no
  restore point covered);
* ``lost_epochs``: over the drains, the epochs between the node's newest epoch and
  the newest epoch the whole job could restore: training lost to the drains;
* ``upgraded``: nodes running *new* when the faulty phase ends.

The oracle checks every invariant as in any run (and V1 on the versions).
"""

from __future__ import annotations

from typing import Protocol

from convergenced.core.drain import drain_target, judge, judge_moves, member_streams
from convergenced.core.facts import Fact
from convergenced.core.spec import StreamSpec
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import Truth
from convergenced.sim.versions import CATALOGUE, SimVersions

STRATEGIES = ("naive", "flip", "gated")
OLD, NEW = CATALOGUE.versions[1], CATALOGUE.versions[2]
START_US = 100_000
"""When the nodes start moving to the new version."""
DOWN_US = 20_000
"""How long a drained node is down."""
NAIVE_EVERY_US = 40_000
"""The naive rolling update's period."""
POLL_US = 2_000
"""How often the gated strategy asks a node's daemon again."""
SAMPLE_US = 1_000
STAGE_US = (20_000, 200_000)
"""When each node installs the build that accepts the new version: some only after
the rollout started (a slow image pull, a node that was busy)."""


class RolloutWorld(Protocol):
    """What a rollout acts on: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    spec: StreamSpec
    truth: Truth
    versions: SimVersions
    gone: set[str]
    phase: str

    def crash(self, nid: str, *, state_lost: bool = False) -> None:
        """Stop ``nid``'s daemon."""

    def restart(self, nid: str) -> None:
        """Start ``nid``'s daemon again from its log."""

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A process of ``nid`` submits ``fact`` to its daemon."""


class Rollout:
    """One strategy's rollout in one run (see the module docstring)."""

    def __init__(self, world: RolloutWorld, strategy: str) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"rollout strategy {strategy!r}: one of {', '.join(STRATEGIES)}")
        self.world = world
        self.strategy = strategy
        self.counts = {"samples": 0, "incompatible": 0, "drains": 0, "unsafe_drains": 0,
                       "lost_epochs": 0, "upgraded": 0, "nodes": 0}  # fmt: skip
        self.order: list[str] = []
        self.down: set[str] = set()
        self.targets: dict[str, int] | None = None

    def start(self) -> None:
        """Schedule the staging, the strategy and the sampling."""
        w = self.world
        rng, loop = w.loop.rng, w.loop
        self.order = list(w.spec.member_ids)
        self.counts["nodes"] = len(self.order)
        w.versions.initial = (OLD, (OLD, NEW))  # a spare the job moves to: a new install
        for nid in self.order:
            w.versions.set_report(nid, OLD, (OLD,))
            loop.at(rng.randint(*STAGE_US), self._stage, nid)
        loop.at(START_US, self._sample)
        if self.strategy == "naive":
            for k, nid in enumerate(self.order):
                loop.at(START_US + k * NAIVE_EVERY_US, self._drain, nid)
        elif self.strategy == "flip":
            for nid in self.order:
                loop.at(int(START_US * w.nodes[nid].skew), self._drain, nid)
        else:
            loop.at(START_US, self._gate_next)

    # -- the steps ----------------------------------------------------------------------

    def _stage(self, nid: str) -> None:
        w = self.world
        running = w.versions.reports[nid].running
        w.submit(nid, w.versions.set_report(nid, running, (OLD, NEW)))  # down: at restart

    def _drain(self, nid: str) -> None:
        w = self.world
        if w.phase != "safety" or nid in w.gone or nid in self.down:
            return
        truth = w.truth
        restorable = truth.convergence().max()
        newest = truth.recoverable(nid).max()
        self.counts["drains"] += 1
        if newest is not None and (restorable is None or restorable < newest):
            self.counts["unsafe_drains"] += 1
            self.counts["lost_epochs"] += newest - (restorable if restorable is not None else -1)
        w.loop.trace(f"rollout drain {nid} newest {newest} restorable {restorable}")
        self.down.add(nid)
        if w.nodes[nid].up:
            w.crash(nid)
        w.versions.set_report(nid, NEW, (OLD, NEW))
        w.loop.after(DOWN_US, self._back, nid)

    def _back(self, nid: str) -> None:
        self.down.discard(nid)
        self.world.restart(nid)  # reports what it runs now (`SimVersions.report`)

    def _gate_next(self) -> None:
        """The gated strategy: drain the next node once its daemon says it is safe,
        and wait for the job to acknowledge it back before the next one."""
        w = self.world
        if w.phase != "safety":
            return
        members = w.spec.member_ids
        todo = [n for n in self.order
                if w.versions.reports[n].running != NEW and n in members]  # fmt: skip
        if not todo or self.down:
            if todo:
                w.loop.after(POLL_US, self._gate_next)
            return
        if self.order and not self._acknowledged():
            w.loop.after(POLL_US, self._gate_next)
            return
        nid = todo[0]
        core = w.nodes[nid].core
        if core is not None and STREAM in core.streams():
            statuses = member_streams(nid, [core.status(s) for s in core.streams()])
            if self.targets is None:  # fixed when the drain is asked, as the daemon does
                self.targets = {s.stream: drain_target(s, checkpoint=False) for s in statuses}
            moves = judge_moves({s.stream: core.versions(s.stream) for s in statuses},
                                {CATALOGUE.component: NEW})  # fmt: skip
            answer = judge(nid, [s for s in statuses if s.stream in self.targets],
                           self.targets, moves)  # fmt: skip
            if answer.safe:
                self.targets = None
                self._drain(nid)
        w.loop.after(POLL_US, self._gate_next)

    def _acknowledged(self) -> bool:
        """Whether every node that moved is seen on the new version by the job, with
        every member's acknowledgement (the rollout driver's last step)."""
        w = self.world
        moved = {m for m in self.order if w.versions.reports[m].running == NEW}
        for nid in w.spec.member_ids:
            core = w.nodes[nid].core
            if core is None or STREAM not in core.streams():
                return False
            (view,) = core.versions(STREAM)
            if any(view.running.get(m) != NEW for m in moved) or not view.compatible:
                return False
        return True

    def _sample(self) -> None:
        w = self.world
        if w.phase != "safety":
            self.counts["upgraded"] = sum(
                1 for n in self.order if w.versions.reports[n].running == NEW
            )
            return
        self.counts["samples"] += 1
        reports = [w.versions.report_of(m) for m in w.spec.member_ids]
        if any(a.running not in b.accepts for a in reports for b in reports):
            self.counts["incompatible"] += 1
        w.loop.after(SAMPLE_US, self._sample)


def table(by_strategy: dict[str, dict[str, int]]) -> list[str]:
    """The comparison's lines for people: one row per strategy (``--rollout``)."""
    rows = [f"{'strategy':<9} {'runs':>5} {'incompatible':>13} {'drains':>7} "
            f"{'unsafe drains':>14} {'epochs lost/drain':>18} {'upgraded':>9}"]  # fmt: skip
    for name, c in by_strategy.items():
        samples, drains = max(c.get("rollout_samples", 0), 1), c.get("rollout_drains", 0)
        rows.append(
            f"{name:<9} {c.get('runs', 0):>5} "
            f"{100 * c.get('rollout_incompatible', 0) / samples:>12.1f}% {drains:>7} "
            f"{100 * c.get('rollout_unsafe_drains', 0) / max(drains, 1):>13.1f}% "
            f"{c.get('rollout_lost_epochs', 0) / max(drains, 1):>18.2f} "
            f"{c.get('rollout_upgraded', 0) / max(c.get('rollout_nodes', 1), 1):>8.0%}"
        )
    return rows
