"""What a node tells its clients about one stream: `StreamStatus`, and how it is read.

A snapshot, computed on request from the node's facts, its agreement and the records
in its view; nothing here changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from convergenced.core.agreement import Decision, Knowledge, StreamAgreement
from convergenced.core.facts import Stored, StreamFacts
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import UNDECLARED, Record
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
    why_no_restore_point: str | None = None
    """When there is no restore point, why, in a sentence (None when there is one)."""
    moved_on: tuple[tuple[str, int], ...] = ()
    """Members whose record names a newer membership than this node's spec, with it:
    the job declared a new member map this node is not in, or has not declared yet
    (PROTOCOL.md 8.1)."""
    stored: Mapping[str, Stored] = field(default_factory=dict)
    """Per domain of the policy, what this node's ranks hold there (`StreamFacts.stored`)."""


def describe(
    me: str,
    facts: StreamFacts,
    agreement: StreamAgreement,
    *,
    decision: Decision,
    records: Mapping[str, Record],
    safe_to_delete: IntervalSet,
    waiting_for: tuple[str, ...] = (),
) -> StreamStatus:
    """The status of one stream at node ``me``, from its parts; ``waiting_for``: the
    members a node unsure of its past must still hear from (`lives`)."""
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
    missing = tuple(m for m in spec.member_ids if m != me and m not in records)
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
        missing=missing,
        conflicts=tuple(sorted((m, dg.hex()) for m, dg in agreement.conflicts.items())),
        newest=newest,
        skew=max(tops) - min(tops) if complete else None,
        generations=tuple(g for g, _ in facts.generations.open_sets()),
        stored=facts.stored(),
        moved_on=tuple(
            (m, r.membership)
            for m in spec.member_ids
            if (r := records.get(m)) is not None and r.membership > spec.membership
        ),
        why_no_restore_point=None
        if d.restore_point is not None
        else _why_none(spec, d, agreement, missing, waiting_for=waiting_for, records=records),
    )


def _why_none(
    spec: StreamSpec,
    d: Decision,
    agreement: StreamAgreement,
    missing: tuple[str, ...],
    *,
    waiting_for: tuple[str, ...],
    records: Mapping[str, Record],
) -> str:
    """Why a node has no restore point, in the terms of PROTOCOL.md section 13."""
    if waiting_for:
        return ("this node started without its log: it waits to hear from "
                f"{', '.join(waiting_for)} what its earlier life published")  # fmt: skip
    gone = [m for m in spec.member_ids if (r := records.get(m)) and r.spec_digest == UNDECLARED]
    if gone:
        return f"undeclared by {', '.join(gone)}: it holds nothing of the stream any more"
    if agreement.conflicts:
        return f"members declared a different spec: {', '.join(sorted(agreement.conflicts))}"
    if missing:
        return f"no record yet from {', '.join(missing)}"
    ci = d.convergence
    if ci is None:
        return ("waiting for records newer than those this node's high-water mark rested "
                "on (older ones may be stale relays)")  # fmt: skip
    if not ci:
        return "no epoch is recoverable on every member (the convergence interval is empty)"
    floor = d.floor
    if floor is not None and not ci.at_least(floor):
        newest = ci.max()
        hint = ""
        if newest is not None:
            hint = (f"; a stream declared with a retention of {floor + spec.retention - newest}"
                    " or more keeps such an epoch as a fallback")  # fmt: skip
        return (f"the newest epoch every member holds, {newest}, is below the rollback floor "
                f"{floor} (the highest high-water mark, {floor + spec.retention}, minus the "
                f"retention, {spec.retention}): older epochs may already be deleted on some "
                f"member{hint}")  # fmt: skip
    return "not every member has proposed an epoch of the convergence interval yet"
