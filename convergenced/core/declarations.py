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
set for a generation its peers may have resolved already (S2).

`Declarations` is NodeCore's part of this (a mixin: it works on the node's state).
"""

from __future__ import annotations

from collections.abc import Callable

from convergenced.core.agreement import StreamAgreement
from convergenced.core.errors import FactError, SpecConflictError, SpecError, UnknownStreamError
from convergenced.core.facts import StreamFacts, Undeclare
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
    _lives: PastLives
    _version: int
    _sign: Callable[[Record], Record] | None
    made_here_record: Callable[[Record], bool]  # EarlierLives'

    def _check_declare(self, spec: StreamSpec) -> None:
        if self.node_id not in spec.member_ids:
            raise SpecError(f"stream {spec.name!r}: this node ({self.node_id}) is not a member")
        st = self._streams.get(spec.name)
        if st is not None and st.facts.spec != spec:
            ours = st.facts.spec
            raise SpecConflictError(
                spec.name, ours.digest.hex()[:16], spec.digest.hex()[:16],
                "; ".join(ours.differences(spec)),
            )  # fmt: skip
        digest = spec.digest
        for origin, rec in self.view.stream(spec.name).items():
            if origin in spec.member_ids and rec.spec_digest not in (digest, UNDECLARED):
                if self.made_here_record(rec):
                    continue  # our own notice of a declaration we refused (`refused`)
                raise SpecConflictError(
                    spec.name, digest.hex()[:16], rec.spec_digest.hex()[:16],
                    f"member {origin} declared (or tried to declare) a different spec",
                )  # fmt: skip

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
        if self._lives.waiting_for(name, spec.member_ids):
            return
        old = self.view.get((name, self.node_id))
        if old is not None and self.made_here_record(old) and old.spec_digest == spec.digest:
            return  # said already
        self._publish_bare(name, spec.digest)

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
        gens = self._streams.pop(fact.stream).generations
        floor = max([gens.closed_below, *(g + 1 for g in (*gens.frozen, *gens.answers))])
        self.close_undeclared(fact.stream, floor)
        self._publish_bare(fact.stream, UNDECLARED)

    def close_undeclared(self, stream: str, below: int) -> None:
        """Keep generations below ``below`` closed for a stream not declared here (from
        an undeclaration, or a compacted log replaying one)."""
        if below > self._generation_floors.get(stream, 0):
            self._generation_floors[stream] = below

    def generations_closed_below(self, stream: str) -> int:
        """Every generation of ``stream`` below this is closed here, whether the stream
        is declared or was undeclared (0: none)."""
        st = self._streams.get(stream)
        if st is not None:
            return st.generations.closed_below
        return self._generation_floors.get(stream, 0)

    def _publish_bare(self, stream: str, digest: bytes) -> None:
        """Publish a record of ours for ``stream`` with ``digest`` and nothing else."""
        self._version += 1
        rec = Record(stream=stream, origin=self.node_id, incarnation=self.incarnation,
                     version=self._version, spec_digest=digest,
                     recoverable=IntervalSet())  # fmt: skip
        if self._sign is not None:
            rec = self._sign(rec)
        self.view.merge(rec)

    def _new_stream(self, spec: StreamSpec) -> StreamState:
        st = StreamState(StreamFacts(spec, self.node_id), StreamAgreement(spec, self.node_id))
        st.generations.close_below(self._generation_floors.pop(spec.name, 0))
        st.agreement.observe_many(list(self.view.stream(spec.name).values()))
        return st
