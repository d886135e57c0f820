"""What a node tells its clients about one stream: `StreamStatus`, and how it is read.

A snapshot, computed on request from the node's facts, its agreement and the records
in its view; nothing here changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from convergenced.core.agreement import Decision, Knowledge, StreamAgreement
from convergenced.core.facts import StreamFacts
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import Record
from convergenced.core.spec import StreamSpec


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """Everything a client may want to know about one stream on this node."""

    stream: str
    spec: StreamSpec
    recoverable: IntervalSet
    convergence: IntervalSet | None
    proposal: int | None
    restore_point: int | None
    knowledge: Knowledge
    high_water: int | None
    rollback_floor: int | None
    gc_horizon: int | None
    safe_to_delete: IntervalSet
    missing: tuple[str, ...]
    conflicts: tuple[tuple[str, str], ...]
    newest: dict[str, dict[str, int]]
    """Per member, per domain, the newest epoch all its ranks hold."""
    skew: int | None
    """max - min over members of their newest recoverable epoch (None if unknown)."""
    generations: tuple[int, ...]


def describe(
    me: str,
    facts: StreamFacts,
    agreement: StreamAgreement,
    *,
    decision: Decision,
    records: Mapping[str, Record],
    safe_to_delete: IntervalSet,
) -> StreamStatus:
    """The status of one stream at node ``me``, from its parts."""
    spec, d = facts.spec, decision
    newest: dict[str, dict[str, int]] = {}
    tops: list[int] = []
    for member in spec.member_ids:
        if member == me:
            newest[member] = facts.newest_by_domain()
            top = facts.recoverable.max()
        else:
            rec = records.get(member)
            if rec is None or member in agreement.conflicts:
                continue
            newest[member] = dict(rec.newest)
            top = rec.recoverable.max()
        if top is not None:
            tops.append(top)
    complete = len(tops) == len(spec.member_ids)
    return StreamStatus(
        stream=spec.name,
        spec=spec,
        recoverable=facts.recoverable,
        convergence=d.convergence,
        proposal=d.proposal,
        restore_point=d.restore_point,
        knowledge=d.knowledge,
        high_water=facts.high_water,
        rollback_floor=d.floor,
        gc_horizon=agreement.gc_horizon(),
        safe_to_delete=safe_to_delete,
        missing=tuple(m for m in spec.member_ids if m != me and m not in records),
        conflicts=tuple(sorted((m, dg.hex()) for m, dg in agreement.conflicts.items())),
        newest=newest,
        skew=max(tops) - min(tops) if complete else None,
        generations=tuple(g for g, _ in facts.generations.open_sets()),
    )
