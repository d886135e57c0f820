"""The version handshake under faults: driver versions that change while the job runs.

Every node of a seed with the ``upgrade`` fault runs with one catalogue
(`CATALOGUE`), reports at its start the version it runs and those it accepts, and
reports again whenever its daemon comes back (as an upgrade hook or the
configuration's seed does). The ``upgrade`` fault changes one node's report: a newer
version or an older one (a rollout rolled back), a wider or narrower set of versions
it accepts (a new release accepted, an old one dropped). The core keeps its
companion streams in line (`core.versions`), so the handshake meets every other
fault of the run: crashes, lost state, partitions, membership changes.

The truth is what the nodes reported. The oracle checks, against it:

* **validity** (as S1): a version a node acknowledges for the job (its companion's
  restore point, as a client reads it: behind the gate) was reported accepted by
  every member of the companion's spec at some time. A version is never
  acknowledged on a guess;
* **liveness** (as S5): once faults stop, every member of the job acknowledges the
  newest version that every member's last report accepts, within the run's bound.

Swarm testing: with every fault enabled, a quarter of the seeds turn ``upgrade`` on.
The choice and the fault's rate come from a random stream of their own, so a seed
without it runs exactly as it did before the fault existed.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Protocol

from convergenced.core.facts import ComponentReport, Fact
from convergenced.core.interval_set import IntervalSet
from convergenced.core.spec import StreamSpec
from convergenced.core.versions import Catalogue
from convergenced.sim.loop import EventLoop
from convergenced.sim.network import STREAM
from convergenced.sim.node import SimNode
from convergenced.sim.oracle import InvariantViolation

CATALOGUE = Catalogue.create("driver", [f"5{i}0.0" for i in range(6)])
"""The fleet's driver versions, oldest first."""
UPGRADE_SHARE = 1 / 4
"""With every fault enabled, the share of seeds that run the version handshake."""
RATE_RANGE = (0.0, 0.1)
"""The ``upgrade`` fault's rate: chance per fault step."""


class VersionsWorld(Protocol):
    """What the version handshake acts on: the world of one run."""

    loop: EventLoop
    nodes: dict[str, SimNode]
    ids: list[str]
    gone: set[str]
    spec: StreamSpec

    def submit(self, nid: str, fact: Fact) -> str | None:
        """A process of ``nid`` submits ``fact`` to its daemon."""


class SimVersions:
    """The reports of one run, their truth and the oracle's checks on them."""

    def __init__(self, world: VersionsWorld, seed: int, *, enabled: bool, sampled: bool) -> None:
        """``enabled``: the ``upgrade`` fault was asked for; ``sampled``: it was asked
        for with every other fault, and swarm testing picks the seeds that run it."""
        self.world = world
        self.rng = random.Random(f"versions/{seed}")
        self.on = enabled and (not sampled or self.rng.random() < UPGRADE_SHARE)
        self.rate = self.rng.uniform(*RATE_RANGE) if self.on else 0.0
        self.reports: dict[str, ComponentReport] = {}
        """Each node's last report (what its hook would report at its next start)."""
        self.ever: defaultdict[str, set[int]] = defaultdict(set)
        """Per node, every catalogue position it ever reported accepting."""
        self.initial: tuple[str, tuple[str, ...]] | None = None
        """The first report of a node that has none yet (None: drawn at random)."""

    def report_of(self, nid: str) -> ComponentReport:
        """``nid``'s last report; the first is drawn when it is first needed."""
        report = self.reports.get(nid)
        if report is None and self.initial is not None:
            report = self.set_report(nid, *self.initial)
        if report is None:
            running = self.rng.randrange(1, len(CATALOGUE.versions) - 1)
            report = self._set(nid, running, running - self.rng.randint(0, 1),
                               running + self.rng.randint(0, 1))  # fmt: skip
        return report

    @staticmethod
    def catalogues() -> list[Catalogue]:
        """The catalogues of every node's configuration."""
        return [CATALOGUE]

    def _set(self, nid: str, running: int, lo: int, hi: int) -> ComponentReport:
        v = CATALOGUE.versions
        return self.set_report(nid, v[running], v[lo : hi + 1])

    def set_report(self, nid: str, running: str, accepts: tuple[str, ...]) -> ComponentReport:
        """``nid`` now runs ``running`` and accepts ``accepts`` (a rollout's steps);
        returns the report, to submit."""
        report = ComponentReport(CATALOGUE.component, running, accepts)
        self.reports[nid] = report
        # The truth reads positions one by one, not through the core's `indices`
        # (the mutation tests break that one).
        self.ever[nid].update(CATALOGUE.versions.index(v) for v in accepts)
        return report

    def report(self, nid: str) -> None:
        """``nid``'s hook reports its versions (at its start, after a restart)."""
        if self.on:
            self.world.submit(nid, self.report_of(nid))

    def upgrade(self) -> bool:
        """The ``upgrade`` fault: one node reports another version or another set of
        versions it accepts. False when no node could."""
        w, rng = self.world, self.rng
        if not rng.random() < self.rate:
            return False
        alive = [nid for nid in w.ids if nid not in w.gone]
        if not alive:
            return False
        nid = rng.choice(alive)
        n = len(CATALOGUE.versions)
        now = CATALOGUE.index(self.report_of(nid).running) or 0
        running = min(max(now + rng.choice([-1, 1, 1]), 0), n - 1)
        lo = max(running - rng.randint(0, 2), 0)
        hi = min(running + rng.randint(0, 2), n - 1)
        report = self._set(nid, running, lo, hi)
        w.loop.trace(f"fault upgrade {nid} {report.running} {','.join(report.accepts)}")
        w.submit(nid, report)  # down: reported again when it starts
        return True

    # -- the oracle -------------------------------------------------------------------

    def check_acknowledged(self, nid: str, version: int | None, spec: StreamSpec) -> None:
        """Validity: ``version``, acknowledged by ``nid`` under the companion ``spec``,
        was reported accepted by every member of it."""
        if version is None:
            return
        for member in spec.member_ids:
            if version not in self.ever[member]:
                name = CATALOGUE.name(version)
                raise InvariantViolation(
                    "V1",
                    f"{nid} acknowledged {name} for the job, which {member} never "
                    f"reported accepting (it reported {sorted(self.ever[member])})",
                )

    def wanted(self) -> str | None:
        """The version every member of the job must acknowledge once faults stop:
        the newest one every member's last report accepts."""
        sets = [CATALOGUE.indices(self.report_of(m).accepts) for m in self.world.spec.member_ids]
        return CATALOGUE.name(IntervalSet.intersect_all(sets).max())

    def converged(self) -> bool:
        """Whether every member of the job acknowledges `wanted` now."""
        if not self.on:
            return True
        want = self.wanted()
        return all(self.acknowledged(m) == want for m in self.world.spec.member_ids)

    def acknowledged(self, nid: str) -> str | None:
        """What ``nid`` acknowledges for the job now ("-": it holds no job)."""
        core = self.world.nodes[nid].core
        if core is None or STREAM not in core.streams():
            return "-"
        return core.versions(STREAM)[0].acknowledged

    def failure(self) -> InvariantViolation:
        """The violation of a run whose members never agreed on `wanted`."""
        got = {m: self.acknowledged(m) for m in self.world.spec.member_ids}
        return InvariantViolation(
            "S5", f"no version handshake on {self.wanted()} after healing: {got}"
        )
