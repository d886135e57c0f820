"""Declaring streams: which declarations a node refuses, and what it tells the others.

A stream is declared by a job on each member's node with one spec; the spec digest
travels in every record (PROTOCOL.md sections 7.4 and 8). A node refuses a
declaration that differs from the one it holds or from a member's record, and then
publishes a *notice* so that the members that declared first see the conflict too.

A job removes a stream from a node by undeclaring it (`Undeclare`): the node forgets
the stream's facts, and publishes a *tombstone* (a record of its own with the
`UNDECLARED` digest and nothing else). The other members then count it as a member
that holds nothing: the convergence interval is empty, their restore point goes (as
a rollback, since the member's checkpoints may now be deleted) and nothing more is
safe to delete for them until they undeclare too. A tombstone never blocks a later
declaration of the stream name, with any spec.

Undeclaring closes every recovery generation the node froze or resolved for the
stream: the node keeps that *generation floor* (in its log, and through compaction as
a `CloseGenerations` fact of a stream it does not hold), and a later declaration of
the name starts with the generations below it closed. A rank of the old job that asks
again is refused `generation_closed` instead of getting a second, different frozen
set for a generation its peers may have resolved already (S2). It keeps the stream's
*high-water mark* too, and a later declaration of the name adopts it: other members
deleted checkpoints on the strength of the restore points this node published
(PROTOCOL.md 13.6), and a first restore point of the new declaration must stay at or
above the mark minus the retention, whatever stale records of theirs the node holds
(13.8). Like a mark adopted after a lost state (13.9), it bounds the rollback floor
and never stands in for a restore point: the new job may not hold the old one's
checkpoints.

A relaunch may declare a new *membership* of a stream: the same name, policy,
retention and scopes (`StreamSpec.same_stream`), another member map, and a higher
``membership`` (the generation the new map applies from). That is no conflict: the
node moves to it (`_change_membership`), keeping the facts of the ranks it still
hosts. Records say which membership their origin declared, so a member that is still
on an older one, or already on a newer one, is told from a conflict: only two
different specs of one membership conflict (PROTOCOL.md section 8.1).

`Declarations` is NodeCore's part of this (a mixin: it works on the node's state).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from convergenced.core.agreement import StreamAgreement
from convergenced.core.errors import FactError, SpecConflictError, SpecError, UnknownStreamError
from convergenced.core.events import MembershipChanged, NodeEvent, RestorePointChanged
from convergenced.core.facts import Fact, HighWater, StreamFacts, Undeclare
from convergenced.core.generations import MembershipSupersededError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.lives import PastLives
from convergenced.core.records import UNDECLARED, Record, View
from convergenced.core.spec import StreamSpec
from convergenced.core.stream_state import StreamState


class Declarations:
    """`NodeCore`'s declaration rules (see the module docstring)."""

    node_id: str
    incarnation: int
    view: View
    _streams: dict[str, StreamState]
    _generation_floors: dict[str, int]
    """Per stream undeclared here: generations below this stay closed (S2)."""
    _high_water_floors: dict[str, int]
    """Per stream undeclared here: the high-water mark it had (S1, see the module
    docstring)."""
    _lives: PastLives
    _version: int
    _sign: Callable[[Record], Record] | None
    _events: deque[NodeEvent]
    made_here_record: Callable[[Record], bool]  # EarlierLives'
    _apply_high_water: Callable[[StreamState, HighWater], None]  # NodeCore's

    def _check_declare(self, spec: StreamSpec) -> None:
        if self.node_id not in spec.member_ids:
            raise SpecError(f"stream {spec.name!r}: this node ({self.node_id}) is not a member")
        st = self._streams.get(spec.name)
        if st is not None and st.facts.spec != spec:
            ours = st.facts.spec
            if not ours.same_stream(spec) or ours.membership == spec.membership:
                raise SpecConflictError(
                    spec.name, ours.digest.hex()[:16], spec.digest.hex()[:16],
                    "; ".join(ours.differences(spec)),
                )  # fmt: skip
            # A new membership of the stream: above everything frozen here.
            st.generations.check_membership(spec.membership)
        digest = spec.digest
        for origin, rec in self.view.stream(spec.name).items():
            if origin in spec.member_ids and rec.spec_digest not in (digest, UNDECLARED):
                if origin == self.node_id and self.made_here_record(rec):
                    continue  # our own notice of a declaration we refused (`refused`)
                if rec.membership < spec.membership:
                    continue  # the member is still on an older membership: it follows
                if rec.membership > spec.membership:
                    raise MembershipSupersededError(
                        spec.name, spec.membership, rec.membership, f"member {origin}"
                    )
                raise SpecConflictError(
                    spec.name, digest.hex()[:16], rec.spec_digest.hex()[:16],
                    f"member {origin} declared (or tried to declare) a different spec "
                    f"for membership {spec.membership}",
                )  # fmt: skip

    def _change_membership(self, st: StreamState, spec: StreamSpec) -> None:
        """Move a declared stream to ``spec``, a new membership of it (checked).

        The facts of the ranks this node still hosts stay; the restore point starts
        over under the new member map (reported as a rollback when there was one: the
        new world may not read it); generations of the older membership stay open,
        protecting their frozen sets, until a newer one resolves. Agreement counts
        only records of the new spec from now on.
        """
        old = st.facts.spec
        old_hosts = {r: n for n, ranks in old.members for r in ranks}
        moved = tuple(sorted(r for n, ranks in spec.members for r in ranks
                             if old_hosts.get(r) != n))  # fmt: skip
        st.facts.rehost(spec)
        fresh = {m: s for m, s in st.agreement.fresh_from.items() if m in spec.member_ids}
        st.agreement = StreamAgreement(spec, self.node_id)
        st.agreement.fresh_from.update(fresh)
        st.agreement.observe_many(list(self.view.stream(spec.name).values()))
        old_rp = st.decision.restore_point if st.decision is not None else None
        st.decision = None
        left = tuple(m for m in old.member_ids if m not in spec.member_ids)
        joined = tuple(m for m in spec.member_ids if m not in old.member_ids)
        replaced = sorted({(old_hosts[r], n) for n, ranks in spec.members for r in ranks
                           if old_hosts.get(r) in left and n in joined})  # fmt: skip
        self._events.append(
            MembershipChanged(spec.name, spec.membership, left, joined, moved, tuple(replaced))
        )
        if old_rp is not None:
            self._events.append(RestorePointChanged(spec.name, old_rp, None, True))

    def refused(self, spec: StreamSpec) -> None:
        """A client's declaration of ``spec`` was refused because a member's record
        names another spec: tell the members that declared first, with a record of
        ours carrying the refused spec's digest and nothing else (PROTOCOL.md 7.4).
        They see the conflict in their state, log and metrics; our declaration of
        the stream, if one comes, supersedes it. Nothing when the stream is declared
        here (our record already says which spec we hold), or while we are unsure of
        our past (nothing of ours leaves before, see `lives`)."""
        name = spec.name
        if name in self._streams or self.node_id not in spec.member_ids:
            return
        if self._lives.waiting_for(name, spec.member_ids, self.view):
            return
        old = self.view.get((name, self.node_id))
        if old is not None and self.made_here_record(old) and old.spec_digest == spec.digest:
            return  # said already
        self._publish_bare(name, spec.digest, spec.membership)

    def _check_undeclare(self, fact: Undeclare) -> None:
        st = self._streams.get(fact.stream)
        if st is None:
            raise UnknownStreamError(fact.stream)
        if not st.settled:
            raise FactError(
                f"stream {fact.stream!r}: this node started without its log and has not "
                "heard from every member yet; undeclare it once it has",
                reason="unsure_of_past",
            )

    def _undeclare(self, fact: Undeclare) -> None:
        """Forget the stream, keep its generation floor and publish its tombstone
        (see the module docstring)."""
        st = self._streams.pop(fact.stream)
        gens = st.generations
        floor = max([gens.closed_below, gens.taken_below,
                     *(g + 1 for g in (*gens.frozen, *gens.answers))])  # fmt: skip
        self.close_undeclared(fact.stream, floor)
        if st.facts.high_water is not None:
            self.keep_undeclared_high_water(fact.stream, st.facts.high_water)
        self._publish_bare(fact.stream, UNDECLARED)

    def close_undeclared(self, stream: str, below: int) -> None:
        """Keep generations below ``below`` closed for a stream not declared here (from
        an undeclaration, or a compacted log replaying one)."""
        if below > self._generation_floors.get(stream, 0):
            self._generation_floors[stream] = below

    def keep_undeclared_high_water(self, stream: str, epoch: int) -> None:
        """Keep ``epoch`` as the high-water mark of ``stream``, not declared here (from
        an undeclaration, or a compacted log replaying one): a later declaration of
        the name adopts it."""
        if epoch > self._high_water_floors.get(stream, -1):
            self._high_water_floors[stream] = epoch

    def undeclared_high_water_fact(self, stream: str, epoch: int) -> HighWater:
        """The `HighWater` that keeps ``epoch`` as the mark of ``stream`` while it is
        not declared here, and that a declaration adopts: one with an entry for this
        node in its evidence (an adopted mark) and of no membership (it never stands
        in for a restore point)."""
        return HighWater(stream, epoch, ((self.node_id, 0, 0),), None)

    def _kept_high_water(self, fact: Fact) -> bool:
        """Whether ``fact`` is the mark of a stream undeclared here, as compaction
        writes it (`undeclared_high_water_fact`); any other fact of a stream not
        declared here is refused."""
        return isinstance(fact, HighWater) and fact == self.undeclared_high_water_fact(
            fact.stream, fact.epoch
        )

    def generations_closed_below(self, stream: str) -> int:
        """Every generation of ``stream`` below this is closed here, whether the stream
        is declared or was undeclared (0: none)."""
        st = self._streams.get(stream)
        if st is not None:
            return st.generations.closed_below
        return self._generation_floors.get(stream, 0)

    def _publish_bare(self, stream: str, digest: bytes, membership: int = 0) -> None:
        """Publish a record of ours for ``stream`` with ``digest`` (and the membership
        of the spec it names) and nothing else."""
        self._version += 1
        rec = Record(stream=stream, origin=self.node_id, incarnation=self.incarnation,
                     version=self._version, spec_digest=digest,
                     recoverable=IntervalSet(), membership=membership)  # fmt: skip
        if self._sign is not None:
            rec = self._sign(rec)
        self.view.merge(rec)

    def _new_stream(self, spec: StreamSpec) -> StreamState:
        st = StreamState(StreamFacts(spec, self.node_id), StreamAgreement(spec, self.node_id))
        st.generations.close_below(self._generation_floors.pop(spec.name, 0))
        kept = self._high_water_floors.pop(spec.name, None)
        if kept is not None:
            self._apply_high_water(st, self.undeclared_high_water_fact(spec.name, kept))
        st.agreement.observe_many(list(self.view.stream(spec.name).values()))
        return st
