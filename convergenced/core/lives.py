"""A node's earlier lives: never going backwards when its state is lost.

A node orders its records by (incarnation, version), and peers keep, per origin, the
record with the highest stamp. A node that loses its state directory (a replaced
disk, a rescheduled pod, an emptyDir gone) comes back with an empty log and would
start again at incarnation 1: below the records its peers still hold of it, which
would then hide everything it says. Worse, those old records carry the node's
high-water mark and the frozen sets of open recovery generations, which other
members may already have used. The rules:

1. **Peers tell.** A link never filters out the peer's own records: a peer sends a
   node any record of that node's origin that the node's HELLO summary shows it
   lacks (known stamps keep a node's current records from bouncing back). A HELLO
   summary lists the expected peer's own records first, so truncation never hides
   them. So a node that lost its state hears of its last life from any peer that
   holds it. A peer that only remembers a stamp of it as evidence of its own
   high-water mark (`facts.HighWater`), and so ignores anything older from that
   origin, drops that evidence when the node itself says that it runs an earlier
   incarnation (its HELLO) or that its own newest record is older (its HELLO summary,
   or the record itself, sent by the node: a node never sends a record of its own it
   did not make in its current life). Only the node can say that of itself: a claim
   in someone else's summary or a relayed record never moves it.
2. **A node that starts without a log is unsure of its past.** Its incarnation comes
   from the log and from a floor kept beside its identity key, which outlives the
   state directory (`daemon.wiring`): records are ordered by (incarnation, version),
   and two lives with one number would hide each other. Without that floor it starts
   at 1 and relies on rule 3 to rise above its earlier lives. Per stream, it
   publishes nothing, reports no restore point, declares nothing safe to delete and
   freezes no generation until it has heard from every member of the stream it
   links to: their HELLO, then the records of its origin that the HELLO's summary
   lists (a peer sends those first; an announced stamp it does not send was only
   evidence), and their own record of the stream, as the summary lists it (rule 4).
   A node that replayed a log knows its last incarnation and starts above it: no
   such wait, unless that log was written by a life still unsure of its past (its
   `Incarnation` says so): then the node is unsure again of every stream that life
   had not settled (`Settled`), since the log holds nothing of that past.
3. **A life it does not remember is above it.** A record of its own origin that it
   did not make in this life (a higher incarnation, or its own incarnation with a
   version it never reached) means its state was lost, or a twin uses its key. It
   takes the next incarnation above every such record (an `Incarnation` fact,
   durable before anything that carries it leaves), reports the loss, and adopts
   from the newest such record of each stream, when the spec is the same: its
   high-water mark (so the rollback floor and S4 hold as before the loss; the
   newest record anyone still holds may be older than the one the peers used to
   collect garbage, so an adopted mark never stands in for a restore point) and its
   frozen sets of generations it knows nothing of (so every member keeps answering
   those generations from the same inputs, S2). Then it publishes what it really
   holds now: its old claims are superseded by an honest record.
4. **Members tell which generations are taken.** A generation resolves only with
   every member's frozen set, so a member that kept its log remembers every
   generation resolved anywhere (open, resolved, or closed below a newer one it
   resolved), and its own record carries it or a newer one. The record of ours
   that rule 3 adopts from may be gone from every view: the members that resolved
   with it may have lost their state too, and a peer that merely restarted rebuilt
   its view of the others from scratch (simulator seed 206217). So the node waits
   for the members' own records too (a HELLO summary lists the sender's own records
   right after the peer's), and as it settles a stream it keeps every generation
   the records it holds carry, and every membership they declare, as *taken*: its
   `Settled` fact carries the bound, and a relaunch it numbers is above it
   (`generations`, rule 6), after a restart too, when the view that showed them is
   gone.

`PastLives` keeps what rules 2 to 4 need; `EarlierLives`, NodeCore's part of the
rules, acts on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from convergenced.core.events import NodeEvent, StateLost
from convergenced.core.facts import Fact, Freeze, HighWater, Incarnation, Settled
from convergenced.core.generations import GenerationState
from convergenced.core.records import Record, View
from convergenced.core.stream_state import StreamState

Stamp = tuple[int, int]


@dataclass
class PastLives:
    """What one node knows of its own earlier lives (see the module docstring)."""

    node_id: str
    unsure: bool
    """True when this process started without a log."""
    plan: frozenset[str] | None = None
    """The peers this node links to (None: every member, as in a full mesh)."""
    heard: set[str] = field(default_factory=set)
    """Peers whose HELLO arrived since this process started."""
    awaited: dict[str, dict[str, Stamp]] = field(default_factory=dict)
    """Per peer, per stream: the stamp of a record of ours it announced and we have
    not received yet."""
    top_seen: int = 0
    """The highest incarnation of ours seen in a verified record (0: none)."""
    reported: bool = False
    """Whether the loss was reported (`StateLost`, once per process)."""
    newest: dict[str, Record] = field(default_factory=dict)
    """Per stream, the newest record of ours from a life we do not remember."""
    announced: dict[str, dict[str, Stamp]] = field(default_factory=dict)
    """Per peer, per stream: the stamp of the peer's own record of the life it runs,
    as its last HELLO listed it (rule 4)."""

    def hello(
        self, peer: str, own: Iterable[tuple[str, Stamp]], theirs: dict[str, Stamp] | None = None
    ) -> None:
        """``peer``'s HELLO arrived; ``own``: (stream, stamp) of our records it holds;
        ``theirs``: per stream, the stamp of its own record of the life it runs (the
        only ones it sends)."""
        self.heard.add(peer)
        self.announced[peer] = dict(theirs or {})
        waiting = {}
        for stream, stamp in own:
            known = self.newest.get(stream)
            if known is None or known.stamp < stamp:
                waiting[stream] = stamp
        if waiting:
            self.awaited[peer] = waiting
        else:
            self.awaited.pop(peer, None)

    def told_all(self, peer: str) -> None:
        """``peer`` holds no more records of ours than it sent."""
        self.awaited.pop(peer, None)

    def learn(self, rec: Record) -> None:
        """A record of ours from a life we do not remember arrived."""
        self.top_seen = max(self.top_seen, rec.incarnation)
        known = self.newest.get(rec.stream)
        if known is None or known.stamp < rec.stamp:
            self.newest[rec.stream] = rec
        for peer in list(self.awaited):
            stamp = self.awaited[peer].get(rec.stream)
            if stamp is not None and stamp <= rec.stamp:
                del self.awaited[peer][rec.stream]
                if not self.awaited[peer]:
                    del self.awaited[peer]

    def top_incarnation(self) -> int:
        """The highest incarnation of ours seen in a verified record (0: none)."""
        return self.top_seen

    def waiting_for(self, stream: str, members: Iterable[str], view: View) -> tuple[str, ...]:
        """Members of ``stream`` we must still hear from before acting on it (rules 2
        and 4): their HELLO, the records of ours they hold, and their own record of
        ``stream`` as their HELLO listed it (``view``: what we hold)."""
        if not self.unsure:
            return ()
        out = []
        for m in members:
            if m == self.node_id or (self.plan is not None and m not in self.plan):
                continue
            if m not in self.heard or stream in self.awaited.get(m, {}):
                out.append(m)
                continue
            stamp = self.announced.get(m, {}).get(stream)
            rec = view.get((stream, m)) if stamp is not None else None
            if stamp is not None and (rec is None or rec.stamp < stamp):
                out.append(m)
        return tuple(out)


class EarlierLives:
    """`NodeCore`'s part of the rules above (a mixin: it works on the node's state)."""

    node_id: str
    incarnation: int
    view: View
    _streams: dict[str, StreamState]
    _lives: PastLives
    _started_at: int
    _version: int
    _pending_facts: list[Fact]
    _events: deque[NodeEvent]

    def _apply(self, fact: Fact) -> str:
        raise NotImplementedError  # NodeCore's

    def _refresh(self, name: str) -> None:
        raise NotImplementedError  # NodeCore's

    def _stream(self, name: str) -> StreamState:
        raise NotImplementedError  # NodeCore's

    def plan_links(self, peers: Iterable[str] | None) -> None:
        """The peers this node links to by its overlay (None: every member, as in a
        full mesh): a node unsure of its past waits to hear from those only."""
        self._lives.plan = None if peers is None else frozenset(peers)
        self._settle()

    def hello_from(
        self, peer: str, incarnation: int, summary: Iterable[tuple[str, str, int, int]]
    ) -> None:
        """``peer``'s HELLO arrived: it runs ``incarnation`` and holds records of these
        (stream, origin, incarnation, version) (a `Link` calls this)."""
        me = self.node_id
        entries = list(summary)
        unknown = [(s, (i, v)) for s, o, i, v in entries
                   if o == me and self._forgotten(i) and not self.made_here(s, i, v)]  # fmt: skip
        theirs: dict[str, Stamp] = {}
        for s, o, i, v in entries:
            if o == peer and (i, v) > theirs.get(s, (-1, -1)):
                theirs[s] = (i, v)
        current = {s: stamp for s, stamp in theirs.items() if stamp[0] == incarnation}
        self._lives.hello(peer, unknown, current)
        for name in sorted(self._streams):
            st = self._streams[name]
            floor = st.agreement.fresh_from.get(peer)
            if floor is None:
                continue
            own = theirs.get(name)
            if incarnation < floor[0] or (own is not None and own < floor):
                # The peer itself says it runs a life, or holds a record of its own,
                # below our evidence of it: it lost its state (rule 1).
                self._drop_evidence(st, peer)
        self._settle()

    def _from_its_origin(self, rec: Record) -> bool:
        """``rec`` came from its origin itself, over an authenticated link: it is that
        node's current record (a node sends no record of its own it did not make in
        its current life). Below our evidence of the origin, it says the origin lost
        its state, as its HELLO would (rule 1). True if evidence was dropped."""
        st = self._streams.get(rec.stream)
        if st is None:
            return False
        floor = st.agreement.fresh_from.get(rec.origin)
        if floor is None or rec.stamp >= floor or self.view.get(rec.key) != rec:
            return False
        self._drop_evidence(st, rec.origin)
        return True

    def _drop_evidence(self, st: StreamState, member: str) -> None:
        """Forget our evidence of ``member``: its records from now on are not stale
        relays of a life it still runs."""
        del st.agreement.fresh_from[member]
        st.facts.evidence.pop(member, None)
        current = self.view.get((st.facts.spec.name, member))
        if current is not None:
            st.agreement.observe_many([current])
        self._refresh(st.facts.spec.name)

    def told_all_of_ours(self, peer: str) -> None:
        """``peer`` sent every record of ours it holds (a `Link` calls this)."""
        self._lives.told_all(peer)
        self._settle()

    def hello_summary(self, first: str | None = None) -> list[tuple[str, str, int, int]]:
        """(stream, origin, incarnation, version) of every record we hold, for a
        HELLO: those of ``first`` first (rule 1), then our own (rule 4)."""
        me = self.node_id
        records = sorted(self.view, key=lambda r: (r.origin != first, r.origin != me))
        return [(r.stream, r.origin, r.incarnation, r.version) for r in records]

    def waiting_to_freeze(self, stream: str) -> tuple[str, ...]:
        """Members this node must hear from before it may freeze a generation of
        ``stream`` (none unless it is unsure of its past, rule 2)."""
        st = self._streams.get(stream)
        if st is None:  # not declared here: every peer it links to (`next_generation`)
            lives = self._lives
            return lives.waiting_for(stream, lives.plan or tuple(lives.announced), self.view)
        return () if st.settled else self._waiting_for(st)

    def _forgotten(self, incarnation: int) -> bool:
        """Whether a life of ours at ``incarnation`` is one this process does not
        remember: any, when it started without a log; else one not below it."""
        return self._lives.unsure or incarnation >= self._started_at

    def made_here_record(self, rec: Record) -> bool:
        """Whether ``rec`` is a record this process published (see `made_here`)."""
        return self.made_here(rec.stream, rec.incarnation, rec.version)

    def made_here(self, stream: str, incarnation: int, version: int) -> bool:
        """Whether a record of ours of ``stream`` with this stamp is one this process
        published (our current record of the stream, or an earlier version of it)."""
        cur = self.view.get((stream, self.node_id))
        return (cur is not None and incarnation == cur.incarnation == self.incarnation
                and version <= cur.version)  # fmt: skip

    def _learn_past(self, records: list[Record]) -> None:
        for rec in records:
            self._lives.learn(rec)
        self._rise()
        for rec in records:
            # Kept for relaying, below our own from now on (merge keeps the newest).
            self.view.merge(rec)
        self._republish()
        self._settle()

    def _rise(self) -> bool:
        """Move above every life of ours seen anywhere, and report the loss (rule 3);
        True if we moved."""
        lives = self._lives
        top = lives.top_incarnation()
        moved = top >= self.incarnation
        if moved:
            self.incarnation = top + 1
            self._pending_facts.append(Incarnation(self.incarnation, self._lives.unsure))
        if top and not lives.reported:
            lives.reported = True
            self._events.append(StateLost(top, self.incarnation))
        return moved

    def _republish(self) -> None:
        """Adopt what we learned and publish again, for the streams already settled."""
        for name in sorted(self._streams):
            st = self._streams[name]
            if st.settled:
                self._adopt(st)
                self._refresh(name)

    def _waiting_for(self, st: StreamState) -> tuple[str, ...]:
        return self._lives.waiting_for(st.facts.spec.name, st.facts.spec.member_ids, self.view)

    def _settle(self) -> None:
        """Publish the streams whose members we have now heard from (rule 2)."""
        for name in sorted(self._streams):
            st = self._streams[name]
            if not st.settled and not self._waiting_for(st):
                self._settled(st)
                self._refresh(name)

    def _settled(self, st: StreamState) -> None:
        """``st``'s members told us what they hold (rule 2): adopt what they told of
        our earlier lives (rule 3), keep the generations their records show as taken
        (rule 4) and, unsure of our past, log it all, so a restart does not wait again."""
        st.settled = True
        self._adopt(st)
        if not self._lives.unsure:
            return
        name = st.facts.spec.name
        records = self.view.stream(name).values()
        top = max([m for r in records for m in (r.membership, *(g for g, _ in r.generations))],
                  default=-1)  # fmt: skip
        st.generations.take_below(top + 1)
        self._pending_facts.append(Settled(name, st.generations.taken_below))

    def replay_settled(self, fact: Settled) -> None:
        """A `Settled` in the log: the life that wrote it knew its past of the stream."""
        st = self._streams.get(fact.stream)
        if st is not None:
            st.settled = True
            st.generations.take_below(fact.taken_below)

    def _adopt(self, st: StreamState) -> None:
        """Take, from the newest record of a life we do not remember, its high-water
        mark and the frozen sets of generations we know nothing of (rule 3)."""
        name = st.facts.spec.name
        old = self._lives.newest.get(name)
        if old is None or old.spec_digest != st.agreement.digest:
            return
        adopted: list[Fact] = []
        hw = st.facts.high_water
        if old.high_water is not None and (hw is None or old.high_water > hw):
            adopted.append(HighWater(name, old.high_water, ((self.node_id, *old.stamp),)))
        unknown = GenerationState.UNKNOWN
        adopted.extend(Freeze(name, g, s) for g, s in old.generations
                       if st.generations.state(g) is unknown)  # fmt: skip
        for fact in adopted:
            self._apply(fact)
            self._pending_facts.append(fact)
