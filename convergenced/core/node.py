"""The node core: local facts, the view, agreement, and our own published records.

`NodeCore` is what one daemon (or one simulated node) runs. It is driven by two
kinds of input and never does I/O:

* **facts** (`apply`): declarations, commits, retractions, retirements and frozen
  sets, which the caller has already made durable;
* **records** (`receive`): from peers, through links.

After either, the node re-evaluates the affected streams and, when anything it
publishes changed, merges a new version of its own record into the view, from
where the links pick it up.

The API is pull-style, as h11's is: after any call, take the events with
`next_event` and the core's own facts with `take_pending_facts`; queries
(`status`, `generation`, `restore_point`, `safe_to_delete`) never change anything.

**Durability contract.** When the restore point rises above the high-water mark,
the core produces a `HighWater` fact (and a `CloseGenerations` fact when a resolved
generation closes older ones), to be taken with `take_pending_facts`. They must be
durable before any byte produced after they appeared leaves the node: other nodes
delete checkpoints on the strength of that mark, so it must survive a crash (see
`agreement`). `convergenced.core.gate.OutputGate` is the one place that enforces it,
for the daemon and the simulator alike.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from convergenced.core.agreement import Decision, Knowledge
from convergenced.core.compaction import Compaction
from convergenced.core.declarations import Declarations
from convergenced.core.errors import FactError, UnknownStreamError
from convergenced.core.events import (
    GenerationResolved,
    MembershipChanged,
    NodeEvent,
    RestorePointChanged,
    SpecConflictDetected,
    StateLost,
)
from convergenced.core.facts import (
    CloseGenerations,
    Commit,
    ComponentReport,
    Declare,
    Fact,
    Freeze,
    HighWater,
    Horizon,
    Incarnation,
    RankState,
    Retire,
    Retract,
    RolloutNote,
    Settled,
    Undeclare,
)
from convergenced.core.generation_requests import GenerationRequests
from convergenced.core.generations import (
    GenerationAnswer,
    GenerationClosedError,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.limits import MAX_RANGES
from convergenced.core.lives import EarlierLives, PastLives
from convergenced.core.node_reads import NodeReads
from convergenced.core.node_versions import NodeVersions
from convergenced.core.records import Record, View
from convergenced.core.status import StreamStatus, describe
from convergenced.core.stream_state import StreamState
from convergenced.core.versions import (
    MAX_ROLLOUT_NOTES,
    Catalogue,
    check_note,
    check_report_shape,
)

__all__ = [
    "GenerationAnswer",
    "GenerationClosedError",
    "GenerationResolved",
    "MembershipChanged",
    "NodeCore",
    "NodeEvent",
    "RestorePointChanged",
    "SpecConflictDetected",
    "StateLost",
    "StreamStatus",
]


class NodeCore(NodeReads, Declarations, EarlierLives, GenerationRequests, NodeVersions, Compaction):
    """One node's protocol state. See the module docstring for the contract."""

    def __init__(
        self,
        node_id: str,
        incarnation: int,
        *,
        sign: Callable[[Record], Record] | None = None,
        verify: Callable[[Record, str | None], str | None] | None = None,
        unsure_of_past: bool = False,
        catalogues: Iterable[Catalogue] = (),
    ) -> None:
        """Args:
        node_id: this node.
        incarnation: bumped (and persisted) at every start.
        unsure_of_past: the node starts without a log (a first start, or a lost
            state directory): it waits to hear from the members it links to before
            publishing anything of a stream (see `lives`).
        sign: returns a record with our signature set; applied to every record we
            publish. None: records are published unsigned (simulator, insecure mode).
        verify: given a received record and the authenticated peer it came from,
            returns why it must not be merged (a short reason) or None. Rejected
            records change nothing; the function does the cryptography (and counts
            the rejection), the core stays free of it.
        catalogues: the fleet's versions of each component, oldest first, for the
            version constraint sets (`versions`).
        """
        self.node_id = node_id
        self.incarnation = incarnation
        self._sign = sign
        self._verify = verify
        self.view = View()
        self._streams: dict[str, StreamState] = {}
        self._generation_floors: dict[str, int] = {}
        self._high_water_floors: dict[str, int] = {}
        self._declared: dict[str, IntervalSet] = {}
        self._version = 0
        self._pending_facts: list[Fact] = []
        self._events: deque[NodeEvent] = deque()
        self._links: dict[str, int] = {}
        self._lives = PastLives(node_id, unsure_of_past)
        self._started_at = incarnation
        self._catalogues = {c.component: c for c in catalogues}
        self._reports: dict[str, ComponentReport] = {}
        self._rollout_notes: deque[str] = deque(maxlen=MAX_ROLLOUT_NOTES)
        self._version_problems: dict[str, str] = {}
        """Lives of ours at or above this one are lives this process does not remember."""

    # -- pulling output -------------------------------------------------------

    def next_event(self) -> NodeEvent | None:
        """The next event (restore point moved, spec conflict, generation resolved),
        or None."""
        return self._events.popleft() if self._events else None

    def take_pending_facts(self) -> list[Fact]:
        """The facts the core produced itself since the last call (high-water marks,
        generation closures): log them before any byte produced after them leaves
        (see the module docstring)."""
        out, self._pending_facts = self._pending_facts, []
        return out

    # -- links ----------------------------------------------------------------

    def link_up(self, peer: str) -> None:
        """An established link to ``peer`` came up (a `Link` calls this)."""
        self._links[peer] = self._links.get(peer, 0) + 1

    def link_down(self, peer: str) -> None:
        """An established link to ``peer`` went down (a `Link` calls this, once)."""
        n = self._links.get(peer, 0) - 1
        if n > 0:
            self._links[peer] = n
        else:
            self._links.pop(peer, None)

    @property
    def neighbours(self) -> frozenset[str]:
        """Peers with at least one established link.

        Counted per link: a reconnect may briefly overlap the link it replaces. Peers
        learn this set from our TICKs and TOCKs and stop relaying those nodes'
        records to us.
        """
        return frozenset(self._links)

    # -- facts ----------------------------------------------------------------

    def incarnation_fact(self) -> Incarnation:
        """The `Incarnation` to log for this life (first in the log, and first in a
        compacted one): it says whether the life is unsure of its past."""
        return Incarnation(self.incarnation, self._lives.unsure)

    def check(self, fact: Fact) -> None:
        """Raise a typed error if ``fact`` would be refused; never changes anything."""
        if isinstance(fact, Declare):
            self._check_declare(fact.spec)
            return
        if isinstance(fact, Incarnation | Settled):
            raise FactError("incarnations are the node's own facts", reason="not_a_client_fact")
        if isinstance(fact, Undeclare):
            self._check_undeclare(fact)
            return
        if isinstance(fact, ComponentReport):
            check_report_shape(fact)
            return
        if isinstance(fact, RolloutNote):
            check_note(fact)
            return
        st = self._streams.get(fact.stream)
        if st is None and isinstance(fact, CloseGenerations):
            return  # the generation floor of a stream undeclared here (compaction)
        if st is None and self._kept_high_water(fact):
            return  # the high-water mark of a stream undeclared here (compaction)
        if st is None:
            raise UnknownStreamError(fact.stream)
        if isinstance(fact, Commit | Retract | Retire):
            st.facts.check(fact)
        elif isinstance(fact, Freeze):
            st.generations.check_freeze(fact.generation)
        elif isinstance(fact, RankState):
            st.facts.check_rank(fact.rank, fact.domain)

    def apply(self, fact: Fact) -> None:
        """Apply a fact (checked first) and re-evaluate its stream.

        The caller logs the fact; nothing it reveals may leave before the log made
        it durable (`convergenced.core.gate`).

        Raises:
            FactError, SpecError, SpecConflictError: refused; nothing changed.
        """
        name = self._apply(fact)
        touched = [name, *self._reconcile_versions()] if self._triggers(fact) else [name]
        for name in touched:
            if name in self._streams:  # not after an undeclaration
                self._refresh(name)

    def apply_many(self, facts: Iterable[Fact], *, checked: bool = False) -> None:
        """Apply facts in order, then re-evaluate each stream they touched once.

        For facts that come together (the commits of one read from a local client):
        each is checked and applied as `apply` would, but the streams are refreshed
        (decision, high-water mark, our record: one version, one signature) once at
        the end instead of after every fact, as `receive` does for a batch of
        records and `replay` for the log. Unlike `apply`, the caller does not log
        the facts: they come out of `take_pending_facts`, in order and ahead of the
        facts the refresh produces, so the gate gives them their positions and
        holds back what reveals them like any fact (`convergenced.core.gate`).

        ``checked``: the caller checked every commit among ``facts`` (`check`)
        against the state before them, as `Admission.submit_commits` does, and they
        are not checked again (other facts still are). A commit changes nothing a
        commit's check reads (the stream's ranks, its retired epochs), so that is
        the same as checking each one as it comes.

        Raises:
            FactError, SpecError, SpecConflictError: a fact was refused; the ones
                before it are applied (and refreshed), it and the rest are not.
        """
        touched: dict[str, None] = {}
        triggered = False
        try:
            for fact in facts:
                # Pending before it is applied: an undeclared stream's Settled, which
                # `_apply` may add, must come after its declaration.
                at = len(self._pending_facts)
                self._pending_facts.append(fact)
                try:
                    touched[self._apply(fact, checked=checked)] = None
                except BaseException:
                    del self._pending_facts[at]  # refused: nothing changed
                    raise
                triggered = triggered or self._triggers(fact)
        finally:
            if triggered:
                touched.update(dict.fromkeys(self._reconcile_versions()))
            for name in touched:
                if name in self._streams:  # not after an undeclaration
                    self._refresh(name)

    def replay(self, facts: Iterable[Fact]) -> None:
        """Rebuild state from the write-ahead log after a restart.

        All facts are applied first and every stream is evaluated once at the end,
        so the restore point starts from the final high-water mark rather than
        from whatever an early prefix of the log implied.
        """
        touched: set[str] = set()
        newest_life, inherited = 0, False
        for fact in facts:
            if isinstance(fact, Incarnation):
                if fact.number >= newest_life:
                    # The newest life logged was unsure of its past (it started
                    # without a log): so are we, but for the streams it settled
                    # (`lives`, rule 2).
                    newest_life, inherited = fact.number, fact.unsure
                    self._lives.unsure = self._lives.unsure or fact.unsure
                continue  # the caller started us above them
            if isinstance(fact, Settled):
                self.replay_settled(fact)
                continue
            if isinstance(fact, Undeclare):
                if fact.stream not in self._streams:
                    continue  # undeclared twice (a client's retry before the restart)
                # The life that logged it knew its past of the stream (the core refuses
                # an undeclaration before that), even where this replay, still unsure
                # from an older life's Incarnation, has not settled the stream again.
                self._streams[fact.stream].settled = True
            touched.add(self._apply(fact))
        if inherited and all(st.settled for st in self._streams.values()):
            self._lives.unsure = False  # that life learned its past of every stream
        # The companions the log lacks (a crash before their facts were logged, a
        # catalogue changed in the configuration), or has too many of.
        touched.update(self._reconcile_versions())
        for name in sorted(touched & set(self._streams)):
            f = self._streams[name].facts
            if f.horizon is None and f.high_water is not None and not f.high_water_adopted:
                # A log from before horizons were kept: every horizon its writer
                # computed was at most this (`agreement`).
                f.horizon = max(f.high_water - f.spec.retention, 0)
            if f.horizon:  # what the last life declared safe is unknown: all below it
                self._declared[name] = IntervalSet.span(0, f.horizon - 1)
            self._refresh(name)

    def _apply(self, fact: Fact, *, checked: bool = False) -> str:
        if not (checked and isinstance(fact, Commit)):
            self.check(fact)
        if isinstance(fact, Declare):
            if fact.spec.name not in self._streams:
                st = self._streams[fact.spec.name] = self._new_stream(fact.spec)
                st.settled = not self._waiting_for(st)
                if st.settled:
                    self._settled(st)
            elif self._streams[fact.spec.name].facts.spec != fact.spec:
                # Checked: a new membership of the stream (`declarations`). A node
                # unsure of its past may have heard from every member of the new map
                # already (the member it waited for left): it settles now.
                self._change_membership(self._streams[fact.spec.name], fact.spec)
                self._settle()
            return fact.spec.name
        assert not isinstance(fact, Incarnation | Settled)
        if isinstance(fact, Undeclare):
            self._undeclare(fact)
            return fact.stream
        if isinstance(fact, ComponentReport):
            self._reports[fact.component] = fact
            return ""
        if isinstance(fact, RolloutNote):
            self._rollout_notes.append(fact.text)
            return ""
        if isinstance(fact, CloseGenerations) and fact.stream not in self._streams:
            self.close_undeclared(fact.stream, fact.below)
            return fact.stream
        if isinstance(fact, HighWater) and fact.stream not in self._streams:
            # Checked: the mark of a stream undeclared here (`_kept_high_water`).
            self.keep_undeclared_high_water(fact.stream, fact.epoch)
            return fact.stream
        st = self._streams[fact.stream]
        if isinstance(fact, Commit | Retract | Retire):
            st.facts.apply_checked(fact)  # checked above (`check`: StreamFacts.check)
        elif isinstance(fact, Freeze):
            st.generations.freeze(fact.generation, fact.epochs)
        elif isinstance(fact, CloseGenerations):
            st.generations.close_below(fact.below)
        elif isinstance(fact, HighWater):
            self._apply_high_water(st, fact)
        elif isinstance(fact, Horizon):
            if st.facts.horizon is None or fact.epoch > st.facts.horizon:
                st.facts.horizon = fact.epoch
        elif isinstance(fact, RankState):
            st.facts.restore_rank(fact)
        return fact.stream

    def _apply_high_water(self, st: StreamState, fact: HighWater) -> None:
        f = st.facts
        adopted = any(m == self.node_id for m, _, _ in fact.evidence)
        hw = f.high_water
        if hw is None or fact.epoch > hw:
            f.evidence.pop(self.node_id, None)  # no longer adopted (an adopted one adds it)
            f.high_water = fact.epoch
        elif adopted:
            return  # an adopted mark below ours says nothing new
        mhw = f.membership_high_water
        if (
            not adopted
            and fact.membership == f.spec.membership
            and (mhw is None or fact.epoch > mhw)
        ):
            f.membership_high_water = fact.epoch
        for member, inc, ver in fact.evidence:
            old = f.evidence.get(member)
            if old is None or (inc, ver) > old:
                f.evidence[member] = (inc, ver)
            if member != self.node_id:
                fresh = st.agreement.fresh_from.get(member)
                if fresh is None or (inc, ver) > fresh:
                    st.agreement.fresh_from[member] = (inc, ver)

    # -- records from peers ---------------------------------------------------

    def receive(self, records: Iterable[Record], *, via: str | None = None) -> list[Record]:
        """Merge records from a peer; re-evaluate touched streams; return those kept.

        Records about ourselves from a previous life are kept for relaying but never
        drive our state; a record claiming *our* current incarnation that we did not
        produce is ignored (another process is using our identity). ``via`` is the
        peer the records came from, as authenticated by the link, for ``verify``.
        """
        kept: list[Record] = []
        by_stream: dict[str, list[Record]] = {}
        verify = self._verify
        past: list[Record] = []
        for rec in records:
            own = rec.origin == self.node_id
            if own and self.made_here(rec.stream, rec.incarnation, rec.version):
                continue  # one of our own, come back
            if verify is not None and verify(rec, via) is not None:
                continue
            if own and self._forgotten(rec.incarnation):
                past.append(rec)  # a life we do not remember (rule 3 of `lives`)
                continue
            merged = self.view.merge(rec)
            if merged:
                kept.append(rec)
            if via == rec.origin and self._from_its_origin(rec):
                continue  # re-evaluated with the evidence gone
            if merged and rec.stream in self._streams:
                by_stream.setdefault(rec.stream, []).append(rec)
        for name in sorted(by_stream):
            # A batch may hold several versions of one origin: the view's winner counts.
            winners = {r.origin: r for r in by_stream[name]}
            current = [self.view.stream(name)[o] for o in winners]
            for rec in self._streams[name].agreement.observe_many(current):
                self._events.append(SpecConflictDetected(name, rec.origin, rec.spec_digest))
            self._refresh(name)
        if past:
            self._learn_past(past)
        elif self._lives.unsure:
            self._settle()  # a member's own record may be the last one waited for
        return kept

    # -- queries --------------------------------------------------------------

    def status(self, stream: str) -> StreamStatus:
        """A consistent snapshot of ``stream`` as this node sees it."""
        st = self._stream(stream)
        assert st.decision is not None  # every declared stream was refreshed at least once
        return describe(self.node_id, st.facts, st.agreement, decision=st.decision,
                        records=self.view.stream(stream),
                        safe_to_delete=self.safe_to_delete(stream),
                        waiting_for=() if st.settled else self._waiting_for(st))  # fmt: skip

    def safe_to_delete(self, stream: str) -> IntervalSet:
        """Epochs this node still holds in some domain that may be deleted now (S4).

        Below the GC horizon, outside every open frozen set, and present: an epoch
        never committed here, or already retired everywhere, is nothing to delete.
        Every answer is remembered: a rank may act on it at any later time, so a
        freeze never keeps one of its epochs (`freeze_fact`).
        """
        st = self._stream(stream)
        horizon = st.agreement.gc_horizon()
        if horizon is None or st.facts.horizon is None or not st.settled:
            return IntervalSet()
        horizon = min(horizon, st.facts.horizon)  # never above what is durable
        if horizon == 0:
            return IntervalSet()
        protected = [s for _, s in st.generations.open_sets()]
        for origin, rec in self.view.stream(stream).items():
            if origin != self.node_id and origin in st.agreement.members:
                protected.extend(s for _, s in rec.generations)
        held = IntervalSet.union_all(st.facts.available.values())
        safe = (held & IntervalSet.span(0, horizon - 1)) - IntervalSet.union_all(protected)
        self._declared[stream] = self._declared.get(stream, IntervalSet()) | safe
        return safe

    def own_record(self, stream: str) -> Record | None:
        """The latest record we published for ``stream``."""
        return self.view.get((stream, self.node_id))

    # -- internals ------------------------------------------------------------

    def _stream(self, name: str) -> StreamState:
        st = self._streams.get(name)
        if st is None:
            raise UnknownStreamError(name)
        return st

    def _refresh(self, name: str) -> None:
        st = self._streams[name]
        f = st.facts
        if not st.settled:
            # Unsure of our past: no restore point yet, neither reported nor published;
            # once settled, the adopted high-water mark stands in for the lost one.
            st.decision = Decision(None, None, None, f.high_water, False, None,
                                   Knowledge.INCOMPLETE)  # fmt: skip
            return
        prev = st.decision
        recoverable = f.recoverable.newest_ranges(MAX_RANGES)
        # With no restore point (after a restart, or after losing it) the high-water
        # mark stands in for it: it was valid, and starting from it keeps S3 across
        # crashes and reports a lower point as the rollback it is.
        # An adopted mark (`lives`, rule 3) may be older than what the peers used, so
        # it only bounds the rollback floor; it never stands in.
        # Only a mark of the current membership stands in: one the job reached with
        # another member map may not be readable by the new world.
        previous = prev.restore_point if prev is not None else None
        if previous is None:
            previous = f.membership_high_water
        d = st.agreement.decide(
            recoverable,
            previous,
            prev.proposal if prev else None,
            f.high_water,
            f.newest_by_domain().items(),
        )
        st.decision = d
        rp, mhw = d.restore_point, f.membership_high_water
        if rp is not None and (mhw is None or rp > mhw):
            if f.high_water is None or rp > f.high_water:
                f.high_water = rp
                f.evidence.pop(self.node_id, None)  # our own mark now, not an adopted one
            f.membership_high_water = rp
            records = self.view.stream(name)
            evidence = tuple(
                (m, r.incarnation, r.version)
                for m in f.spec.member_ids
                if m != self.node_id and (r := records.get(m)) is not None
            )
            f.evidence.update((m, (i, v)) for m, i, v in evidence)
            self._pending_facts.append(HighWater(name, rp, evidence, f.spec.membership))
        horizon = st.agreement.gc_horizon()
        if horizon is not None and (f.horizon is None or horizon > f.horizon):
            f.horizon = horizon
            self._pending_facts.append(Horizon(name, horizon))
        old_rp = prev.restore_point if prev else None
        if d.restore_point != old_rp:
            self._events.append(RestorePointChanged(name, old_rp, d.restore_point, d.rollback))
        self._resolve_ready(st)
        self._publish(st)

    def _publish(self, st: StreamState) -> None:
        f, d = st.facts, st.decision
        assert d is not None
        if not st.settled:
            return  # nothing of ours leaves before we know our past (see `lives`)
        newest = tuple(sorted(f.newest_by_domain().items()))
        gens = st.generations.open_sets()
        # A record carries at most MAX_RANGES ranges, which peers enforce: the oldest
        # go first. Publishing fewer epochs only shrinks the convergence interval,
        # which can delay agreement but never make it wrong (S1).
        recoverable = f.recoverable.newest_ranges(MAX_RANGES)
        old = self.view.get((f.spec.name, self.node_id))
        if (
            old is not None
            and old.incarnation == self.incarnation
            and old.spec_digest == st.agreement.digest  # not a notice (`refused`)
            and old.recoverable == recoverable
            and old.newest == newest
            and old.proposal == d.proposal
            and old.restore_point == d.restore_point
            and old.high_water == f.high_water
            and old.generations == gens
        ):
            return
        self._version += 1
        rec = Record(
            stream=f.spec.name,
            origin=self.node_id,
            incarnation=self.incarnation,
            version=self._version,
            spec_digest=st.agreement.digest,
            recoverable=recoverable,
            newest=newest,
            proposal=d.proposal,
            restore_point=d.restore_point,
            high_water=f.high_water,
            generations=gens,
            membership=f.spec.membership,
        )
        if self._sign is not None:
            rec = self._sign(rec)
        self.view.merge(rec)
