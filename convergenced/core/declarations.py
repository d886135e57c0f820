"""Declaring streams: which declarations a node refuses, and what it tells the others.

A stream is declared by a job on each member's node with one spec; the spec digest
travels in every record (PROTOCOL.md sections 7.4 and 8). A node refuses a
declaration that differs from the one it holds or from a member's record, and then
publishes a *notice* so that the members that declared first see the conflict too.

`Declarations` is NodeCore's part of this (a mixin: it works on the node's state).
"""

from __future__ import annotations

from collections.abc import Callable

from convergenced.core.agreement import StreamAgreement
from convergenced.core.errors import SpecConflictError, SpecError
from convergenced.core.facts import StreamFacts
from convergenced.core.interval_set import IntervalSet
from convergenced.core.lives import PastLives
from convergenced.core.records import Record, View
from convergenced.core.spec import StreamSpec
from convergenced.core.stream_state import StreamState


class Declarations:
    """`NodeCore`'s declaration rules (see the module docstring)."""

    node_id: str
    incarnation: int
    view: View
    _streams: dict[str, StreamState]
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
            if origin in spec.member_ids and rec.spec_digest != digest:
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
        self._version += 1
        rec = Record(stream=name, origin=self.node_id, incarnation=self.incarnation,
                     version=self._version, spec_digest=spec.digest,
                     recoverable=IntervalSet())  # fmt: skip
        if self._sign is not None:
            rec = self._sign(rec)
        self.view.merge(rec)

    def _new_stream(self, spec: StreamSpec) -> StreamState:
        st = StreamState(StreamFacts(spec, self.node_id), StreamAgreement(spec, self.node_id))
        st.agreement.observe_many(list(self.view.stream(spec.name).values()))
        return st
