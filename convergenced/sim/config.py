"""What one simulated run is given (`SimConfig`) and what it found (`Result`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from convergenced.core.overlay import DEFAULT_MESH_LIMIT
from convergenced.sim.faults import FAULTS
from convergenced.sim.oracle import InvariantViolation


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
    compare: frozenset[str] = frozenset()
    """The baselines to score (`baselines`): ``marker``, ``torchtitan``."""
    check_every_event: bool = True
    """Re-check S1 on every node's current restore point after every event (on top of
    the checks made where a restore point, a generation answer or a deletion
    happens). Skipped past 64 nodes, where it would dominate the run time."""
    workload: bool = True
    """False: only the final commit of the liveness phase (for scale runs)."""
    rollout: str | None = None
    """A driver rollout during the faulty phase, by this strategy (`rollouts`):
    ``naive``, ``flip`` or ``gated``."""
    credentials: bool = False
    """CA-bound trust (`trust`): links gossip credentials (wire version 3), records
    are signed and checked against them, and a lost incarnation floor loses the
    identity key with it. False: unsigned records, as with trust lists."""
    churn: int = 0
    """Membership changes at fixed times instead of at drawn rates: this many, evenly
    spaced over the faulty phase, cycling through the enabled membership faults
    (`faults.churn_plan`). A drawn rate gives each seed its own number of changes;
    a scale run needs the same number at every N, or its cost per N compares seeds,
    not sizes. 0: the rates decide, as in every other run."""


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
    compare: dict[str, int] = field(default_factory=dict)
    """The baselines' counts (`baselines`): ``marker_samples``, ``marker_mixed``..."""
    restore_point: int | None = None
    bytes_per_node_per_round: float = 0.0
    refused_records: int = 0
    """Records refused for their signature (CA-bound trust, after a lost key)."""
