"""Version constraint sets: which driver, firmware, NCCL or OS versions every member
of a job accepts, agreed with the same lattice as checkpoints.

Each node states, per *component* (``driver``, ``firmware``, ``nccl``, ``os``, any
name), the version it runs and the versions it can work with beside it
(`ComponentReport`, a fact of the log). Versions are opaque strings; the fleet's
*catalogue* of a component (the daemon's configuration) lists them oldest first, and
that order turns a set of versions into a set of integers: an interval set, the
lattice the rest of the core already agrees on.

So, for every stream a job declares here and every component with a catalogue, the
node keeps a *companion stream* (`companion_spec`): the job's members and ranks, a
reserved name, and a policy "any of [accepts, running]". Each rank the node hosts
commits, as epochs, the catalogue indices of the versions the node accepts (domain
``accepts``) and the one it runs (domain ``running``). The companion's agreement then
says, with no new protocol:

* its convergence interval: the versions every member of the job accepts (phase one);
* its restore point: the newest version every member has proposed, so every member
  knows that every member accepts it; with knowledge ``published``, every member has
  acknowledged that too (phase two). A node moves to a version only then (`judge_move`);
* its members' ``newest`` of ``running``: what each member runs now, so a job whose
  members run versions that some member does not accept is seen (`ComponentView`);
* the versions below both the acknowledged one and every member's running one: no
  member needs them any more, the analogue of the GC horizon (``droppable``).

A version a node stops accepting is retracted from its companions, never retired:
a node may come to accept it again (a rollout rolled back), and a retired epoch can
never be committed again. Dropping the acknowledged version shows as a rollback of
the companion's restore point, as losing a checkpoint does.

The catalogue's digest is part of every companion name, so two nodes whose
catalogues differ publish into different streams and never read each other's
indices as the same versions: their handshake waits (fail closed) until the
configuration agrees. The companions are derived state: `reconcile` computes, from
the declared streams, the catalogues and the reports, the facts that bring them in
line, and `NodeCore` applies and logs those facts like its other own facts, so the
simulator and the daemon run the same rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from convergenced.core.agreement import Knowledge
from convergenced.core.errors import FactError
from convergenced.core.facts import (
    Commit,
    ComponentReport,
    Declare,
    Fact,
    Retract,
    RolloutNote,
    Undeclare,
)
from convergenced.core.interval_set import EMPTY, IntervalSet
from convergenced.core.packing import pack
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.status import StreamStatus
from convergenced.core.validate import NAME_RE

RESERVED_PREFIX = "convergenced.versions/"
"""Stream names under this prefix belong to the daemon; a job may not declare one."""
ACCEPTS = "accepts"
RUNNING = "running"
COMPANION_POLICY = Policy.any_of(ACCEPTS, RUNNING)
MAX_COMPONENTS = 8
"""Components with a catalogue: each job stream gets one companion per component."""
MAX_VERSIONS = 256
"""Versions in one catalogue."""
MAX_VERSION_CHARS = 64
"""One version string."""
MAX_COMPONENT_CHARS = 32
"""A component name."""
MAX_ROLLOUT_NOTES = 64
"""Rollout audit notes a node keeps (the oldest go first)."""
MAX_NOTE_CHARS = 4096
"""One rollout audit note."""


class VersionError(FactError):
    """A component report or catalogue that cannot be accepted; nothing changed."""

    def __init__(self, message: str, *, reason: str = "bad_version") -> None:
        super().__init__(message, reason=reason)


def is_reserved(stream: str) -> bool:
    """Whether ``stream`` is a companion stream of the daemon's, not a job's."""
    return stream.startswith(RESERVED_PREFIX)


def _check_version(value: object, path: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_VERSION_CHARS:
        raise VersionError(f"{path}: expected a version string of 1 to {MAX_VERSION_CHARS} chars")
    if not value.isprintable() or value != value.strip():
        raise VersionError(f"{path}: {value!r} has blanks at its ends or unprintable chars")
    return value


def check_component_name(name: object, path: str = "component") -> str:
    """A component name: a stream-name-like word of at most 32 chars, no slash."""
    if (not isinstance(name, str) or len(name) > MAX_COMPONENT_CHARS or "/" in name
            or not NAME_RE.match(name)):  # fmt: skip
        raise VersionError(f"{path}: {name!r} is not a component name (letters, digits, "
                        f"'.', '_', '-', at most {MAX_COMPONENT_CHARS} chars)")  # fmt: skip
    return name


@dataclass(frozen=True, slots=True)
class Catalogue:
    """The fleet's versions of one component, oldest first: their order is the
    lattice's. Build with `Catalogue.create`, which validates."""

    component: str
    versions: tuple[str, ...]

    @classmethod
    def create(cls, component: str, versions: Iterable[str]) -> Catalogue:
        """Raises:
        VersionError: a bad name, a bad or repeated version, too many versions."""
        check_component_name(component, "catalogue.component")
        vs = tuple(versions)
        if not vs:
            raise VersionError(f"catalogue {component}: list at least one version")
        if len(vs) > MAX_VERSIONS:
            raise VersionError(f"catalogue {component}: {len(vs)} versions above {MAX_VERSIONS}")
        for i, v in enumerate(vs):
            _check_version(v, f"catalogue {component}.versions[{i}]")
        if len(set(vs)) != len(vs):
            raise VersionError(f"catalogue {component}: a version is listed twice")
        return cls(component, vs)

    @property
    def digest(self) -> str:
        """Eight hex chars of SHA-256 over the component and its ordered versions."""
        return hashlib.sha256(pack([self.component, list(self.versions)])).hexdigest()[:8]

    def index(self, version: str) -> int | None:
        """The position of ``version`` (its epoch in the companions), or None."""
        try:
            return self.versions.index(version)
        except ValueError:
            return None

    def indices(self, versions: Iterable[str]) -> IntervalSet:
        """The positions of the ``versions`` the catalogue lists (others are left out)."""
        found = (self.index(v) for v in versions)
        return IntervalSet.of(*(i for i in found if i is not None))

    def names(self, epochs: IntervalSet | None) -> tuple[str, ...]:
        """The versions at the positions ``epochs`` holds, oldest first."""
        if epochs is None:
            return ()
        return tuple(v for i, v in enumerate(self.versions) if i in epochs)

    def name(self, epoch: int | None) -> str | None:
        """The version at position ``epoch`` (None when out of the catalogue)."""
        if epoch is None or not 0 <= epoch < len(self.versions):
            return None
        return self.versions[epoch]

    def prefix(self) -> str:
        """The start of every companion name of this catalogue."""
        return f"{RESERVED_PREFIX}{self.component}/{self.digest}/"

    def companion_name(self, job: str) -> str:
        """The companion of job stream ``job`` for this component."""
        return self.prefix() + hashlib.sha256(job.encode()).hexdigest()[:16]


def check_report_shape(report: ComponentReport) -> None:
    """Raise FactError unless ``report`` is well formed: a component name, version
    strings within their limits, and the version run among those accepted."""
    check_component_name(report.component)
    if len(report.accepts) > MAX_VERSIONS:
        raise VersionError(f"accepts: {len(report.accepts)} versions above {MAX_VERSIONS}")
    for i, v in enumerate((report.running, *report.accepts)):
        _check_version(v, "running" if i == 0 else f"accepts[{i - 1}]")
    if report.running not in report.accepts:
        raise VersionError(f"accepts: a node accepts the version it runs ({report.running!r})")


def check_report(report: ComponentReport, catalogue: Catalogue | None) -> None:
    """Raise FactError unless ``report`` is well formed and names versions of
    ``catalogue`` only (what a client may report; a log may hold reports of versions
    a later catalogue dropped, which count for nothing)."""
    check_report_shape(report)
    if catalogue is None:
        raise VersionError(f"component {report.component!r} has no catalogue in this "
                        "daemon's configuration", reason="unknown_component")  # fmt: skip
    for v in (report.running, *report.accepts):
        if catalogue.index(v) is None:
            raise VersionError(f"version {v!r} is not in the catalogue of {report.component}",
                            reason="unknown_version")  # fmt: skip


def check_note(note: RolloutNote) -> None:
    """Raise VersionError unless ``note`` is text within `MAX_NOTE_CHARS`."""
    if not isinstance(note.text, str) or not 0 < len(note.text) <= MAX_NOTE_CHARS:
        raise VersionError(f"note: expected 1 to {MAX_NOTE_CHARS} chars of text",
                           reason="bad_note")  # fmt: skip


COMPANION_RETENTION = MAX_VERSIONS
"""The companions' retention: a rollback of the acknowledged version may go to any
older version of the catalogue. (A checkpoint stream's retention bounds how far back
a rollback may go, since the members delete what lies below it; nothing is ever
deleted for a version, and with a smaller retention a fleet that stopped accepting
its newest version could acknowledge none at all.)"""


def companion_spec(job: StreamSpec, catalogue: Catalogue) -> StreamSpec:
    """The companion of ``job`` for ``catalogue``'s component: the same members,
    ranks and membership, the reserved name and policy, `COMPANION_RETENTION`."""
    return StreamSpec.create(
        catalogue.companion_name(job.name),
        dict(job.members),
        COMPANION_POLICY,
        COMPANION_RETENTION,
        membership=job.membership,
    )


@dataclass(frozen=True, slots=True)
class Companion:
    """What a companion stream holds on this node now (for `reconcile`)."""

    spec: StreamSpec
    available: Mapping[tuple[int, str], IntervalSet]


def reconcile(
    node: str,
    jobs: Iterable[StreamSpec],
    catalogues: Mapping[str, Catalogue],
    reports: Mapping[str, ComponentReport],
    companions: Mapping[str, Companion],
) -> list[Fact]:
    """The facts that bring the companion streams in line with the declared ``jobs``,
    the ``catalogues`` and this node's ``reports`` (see the module docstring).

    Declarations come before the commits of their stream, retractions before an
    undeclaration is not needed (it forgets everything). Applying the result to a
    node whose companions are ``companions`` gives what `reconcile` would then
    answer with an empty list.
    """
    wanted: dict[str, tuple[StreamSpec, IntervalSet, IntervalSet]] = {}
    for job in jobs:
        for component in sorted(catalogues):
            catalogue, report = catalogues[component], reports.get(component)
            if report is None:
                continue
            spec = companion_spec(job, catalogue)
            accepts = catalogue.indices(report.accepts)
            running = catalogue.indices([report.running])
            wanted[spec.name] = (spec, accepts, running)
    out: list[Fact] = []
    for name in sorted(set(companions) - set(wanted)):
        out.append(Undeclare(name))
    for name, (spec, accepts, running) in sorted(wanted.items()):
        held = companions.get(name)
        if held is None or held.spec != spec:
            out.append(Declare(spec))
        have = held.available if held is not None and held.spec == spec else {}
        for rank in spec.ranks_of(node):
            for domain, want in ((ACCEPTS, accepts), (RUNNING, running)):
                got = have.get((rank, domain), EMPTY)
                for epoch in got.difference(want):
                    out.append(Retract(name, rank, domain, epoch))
                for epoch in want.difference(got):
                    out.append(Commit(name, rank, domain, epoch))
    return out


@dataclass(frozen=True, slots=True)
class ComponentView:
    """One component of one job, as this node sees it (read-only)."""

    stream: str
    """The job's stream."""
    component: str
    companion: str
    declared: bool
    """False: this node has no companion for it yet (no report of its own)."""
    running: Mapping[str, str | None]
    """Per member heard from, the version it runs (None: one outside the catalogue)."""
    accepted_by_all: tuple[str, ...] | None
    """The versions every member accepts (None: not every member is heard from)."""
    acknowledged: str | None
    """The newest version every member accepts and has proposed (phase one done)."""
    knowledge: Knowledge
    """``published``: every member acknowledged ``acknowledged`` (phase two)."""
    compatible: bool | None
    """Every member accepts every version the members run (None: unknown)."""
    droppable: tuple[str, ...]
    """Versions no member runs or needs: older than the acknowledged one and than
    every member's running one."""
    missing: tuple[str, ...]
    """Members not heard from (or in conflict)."""


def view_component(
    job: str, catalogue: Catalogue, status: StreamStatus | None, members: Iterable[str]
) -> ComponentView:
    """The `ComponentView` of ``job`` from its companion's status (None: no companion)."""
    name = catalogue.companion_name(job)
    if status is None:
        return ComponentView(job, catalogue.component, name, False, {}, None, None,
                             Knowledge.INCOMPLETE, None, (), tuple(sorted(members)))  # fmt: skip
    running: dict[str, str | None] = {}
    for member, newest in sorted(status.newest.items()):
        if RUNNING in newest:
            running[member] = catalogue.name(newest[RUNNING])
    accepted = catalogue.names(status.convergence) if status.convergence is not None else None
    complete = accepted is not None and len(running) == len(status.spec.member_ids)
    compatible = None
    if complete and accepted is not None:
        compatible = all(v in accepted for v in running.values())
    droppable: tuple[str, ...] = ()
    rp = status.restore_point
    if complete and rp is not None and status.knowledge >= Knowledge.PUBLISHED:
        floor = min([rp] + [catalogue.index(v) or 0 for v in running.values() if v])
        droppable = catalogue.versions[:floor]
    return ComponentView(
        job, catalogue.component, name, True, running, accepted, catalogue.name(rp),
        status.knowledge, compatible, droppable, status.missing,
    )  # fmt: skip


def judge_move(view: ComponentView, version: str) -> str:
    """Why this node may not move to ``version`` of the view's component yet, in a
    sentence; "" when every member accepts it and has acknowledged that."""
    c, j = view.component, view.stream
    if not view.declared:
        return f"{j}: this node reports no {c} version"
    if view.accepted_by_all is None:
        waits = ", ".join(view.missing) or "every member"
        return f"{j}: waits to hear the {c} versions of {waits}"
    if version not in view.accepted_by_all:
        return f"{j}: not every member accepts {c} {version}"
    # Both lists are in catalogue order: a version at or below the acknowledged one.
    accepted, acked = view.accepted_by_all, view.acknowledged
    if acked not in accepted or accepted.index(version) > accepted.index(acked):
        return f"{j}: {c} {version} is not yet acknowledged by every member"
    if view.knowledge < Knowledge.PUBLISHED:
        return (f"{j}: {c} {view.acknowledged} is acknowledged but not yet published "
                f"by every member (knowledge {view.knowledge.name.lower()})")  # fmt: skip
    return ""


def fleet_accepts(
    catalogue: Catalogue, records: Iterable[tuple[str, IntervalSet]]
) -> tuple[tuple[str, ...], int]:
    """The versions that every node heard from accepts, and how many nodes that is.

    ``records`` are (origin, recoverable set) of every companion of ``catalogue``
    this node holds, its own included: every node relays every record, so this is
    the fleet as far as it has reached here. A node that hosts no job publishes no
    companion and is not counted.
    """
    held = list(records)
    sets = [s for _, s in held]
    everything = IntervalSet.span(0, len(catalogue.versions) - 1)
    out = IntervalSet.intersect_all([everything, *sets])
    return catalogue.names(out), len({origin for origin, _ in held})
