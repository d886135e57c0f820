"""The local API's results: what the daemon's state and generation answers look like
on the wire (``proto/LOCAL_API.md``), apart from the framing and the requests of
`local_api_codec`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from convergenced.core.drain import DrainAnswer, drain_target, judge_stream
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import GenerationAnswer, NodeCore, StreamStatus
from convergenced.core.versions import ComponentView


def intervals(s: IntervalSet | None) -> list[list[int]] | None:
    """An interval set as ``[[lo, hi], ...]`` (inclusive), or nil."""
    return None if s is None else [[lo, hi] for lo, hi in s.ranges]


def status_to_wire(s: StreamStatus, checkpoint_after: int | None = None) -> dict[str, Any]:
    """The ``state`` result: everything one stream looks like from this node;
    ``checkpoint_after``: a drain asks the job for a checkpoint newer than this
    (`drain.CheckpointRequests.pending`)."""
    return {
        "stream": s.stream,
        "spec": s.spec.to_wire(),
        "recoverable": intervals(s.recoverable),
        "convergence": intervals(s.convergence),
        "proposal": s.proposal,
        "restore_point": s.restore_point,
        "why_no_restore_point": s.why_no_restore_point,
        "knowledge": s.knowledge.name.lower(),
        "high_water": s.high_water,
        "rollback_floor": s.rollback_floor,
        "gc_horizon": s.gc_horizon,
        "safe_to_delete": intervals(s.safe_to_delete),
        "missing": list(s.missing),
        "conflicts": [list(c) for c in s.conflicts],
        "newest": {m: dict(d) for m, d in s.newest.items()},
        "skew": s.skew,
        "domain_skew": domain_skew(s.newest),
        "generations": list(s.generations),
        # Memberships (PROTOCOL.md 8.1): generations below the spec's membership were
        # frozen under an older member map and are never answered again here.
        "membership": s.spec.membership,
        "older_map_generations": [g for g in s.generations if g < s.spec.membership],
        "moved_on": dict(s.moved_on),
        # What this node's ranks hold (committed, neither retracted nor retired), per
        # domain of the policy: the sizes their commits stated, and the epochs.
        "stored_bytes": {d: st.bytes for d, st in s.stored.items()},
        "stored_epochs": {d: st.epochs for d, st in s.stored.items()},
        # The drain gate (`drain`): would draining this node now lose no epoch it
        # holds, and does a drain ask the job for a checkpoint?
        "drain_safe": judge_stream(s, drain_target(s, checkpoint=False)).safe,
        "checkpoint_requested": None if checkpoint_after is None else {"after": checkpoint_after},
    }


def drain_to_wire(answer: DrainAnswer) -> dict[str, Any]:
    """The ``drain`` result."""
    return {
        "node": answer.node,
        "safe": answer.safe,
        "streams": {
            v.stream: {
                "safe": v.safe,
                "target": v.target,
                "restore_point": v.restore_point,
                "knowledge": v.knowledge.name.lower(),
                "reason": v.reason,
            }
            for v in answer.streams
        },
        "versions": [
            {"stream": m.stream, "component": m.component, "version": m.version,
             "safe": not m.reason, "reason": m.reason}
            for m in answer.moves
        ],
    }  # fmt: skip


def component_view_to_wire(v: ComponentView) -> dict[str, Any]:
    """One component of one job in the ``versions`` result."""
    return {
        "declared": v.declared,
        "running": dict(v.running),
        "accepted_by_all": None if v.accepted_by_all is None else list(v.accepted_by_all),
        "acknowledged": v.acknowledged,
        "knowledge": v.knowledge.name.lower(),
        "compatible": v.compatible,
        "droppable": list(v.droppable),
        "missing": list(v.missing),
    }


def versions_to_wire(node: NodeCore, streams: list[str]) -> dict[str, Any]:
    """The ``versions`` result: the catalogues, this node's reports, the fleet and,
    per job of ``streams``, each component's handshake."""
    reports = node.reports()
    fleet = node.fleet_versions()
    return {
        "node": node.node_id,
        "components": {
            c: {
                "catalogue": list(cat.versions),
                "running": reports[c].running if c in reports else None,
                "accepts": list(reports[c].accepts) if c in reports else None,
                "fleet_accepts": list(fleet[c][0]),
                "fleet_nodes": fleet[c][1],
            }
            for c, cat in sorted(node.catalogues.items())
        },
        "streams": {
            s: {v.component: component_view_to_wire(v) for v in node.versions(s)} for s in streams
        },
        "rollout_notes": node.rollout_notes(),
    }


def domain_skew(newest: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """Per domain, max - min over members of their newest epoch in that domain.

    Only members that reported the domain count; a domain nobody reported is absent.
    """
    by_domain: dict[str, list[int]] = {}
    for domains in newest.values():
        for d, e in domains.items():
            by_domain.setdefault(d, []).append(e)
    return {d: max(es) - min(es) for d, es in sorted(by_domain.items())}


def generation_to_wire(stream: str, g: GenerationAnswer) -> dict[str, Any]:
    """The ``restore_point`` result."""
    return {
        "stream": stream,
        "generation": g.generation,
        "resolved": g.resolved,
        "restore_point": g.restore_point,
        "waiting_for": list(g.waiting_for),
        "lost": g.lost,
    }
