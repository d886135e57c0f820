"""Recovery generations: the lifecycle of one generation on one node, and its rules.

Everything that affects a generation's state and its transitions lives in this
module (as the link's do in `link`). A job that restarts after a failure asks its
daemon for the restore point of a *recovery generation* g, a number its launcher
chooses. The rules:

1. **Freeze.** At this node's first request for g, its recoverable set is *frozen*
   for g, keeping the epochs at or above the highest GC horizon it computed (its
   ``high_water - retention`` when it knows none), and those in any frozen set
   another member has already published for g, minus every epoch this node ever
   declared safe to delete (a rank may be deleting it; after a restart, everything
   below that horizon). Another member's set can reach below what our horizon passed
   before it arrived (that member's own horizon lagged), so the subtraction matters.
   So members that ask seconds apart, while the restore point moves on, still share
   the epochs the first one froze. At most the newest `MAX_RANGES` ranges are kept.
   The frozen set is a fact: it is made durable before anything that reveals it
   leaves the node, and it is published in our record.
2. **Resolve.** g is resolved once the frozen set of every member is known (ours,
   and each other member's from a record with our spec digest). Its answer is the
   newest epoch of the intersection of all frozen sets, or None when they share no
   epoch. Every member computes it from the same inputs, so every member returns
   the same answer (S2), however late its uploads keep committing; a member that
   lacks one frozen set waits, it never guesses.
3. **Answers are final.** A resolved answer never changes. If its epoch is later
   lost (a retraction takes it out of the convergence interval), the answer says
   ``lost`` and the job opens a newer generation.
4. **Close.** A resolved generation supersedes every older one: they are closed, and
   their frozen sets stop protecting epochs from garbage collection (S4 only needs
   the sets of open generations). Closing is persisted (`CloseGenerations`), so a
   late request for a closed generation is refused at once instead of waiting
   forever on frozen sets its peers already dropped. A node keeps at most
   `MAX_GENERATIONS` open; freezing one more closes the oldest.
5. A closed generation that this process resolved still answers (rule 3); one that
   never resolved here is refused with `GenerationClosedError`.
6. **A relaunch opens a new generation** (`next_generation`): one rank of the new
   launch asks its daemon for the number and hands it to the launch's other ranks,
   instead of a launcher's counter (which starts again at 0 with every new launch).
   The number is above every generation this node froze, resolved or closed, every
   one in the members' records, and every one this node keeps as *taken*: those the
   members' records carried when it settled a stream after losing its state
   (`lives`, rule 4). No member can have resolved it (that needed this node's frozen
   set of it, which this node remembers, or adopts from its peers when it lost its
   state, or, when no peer holds that any more, learns of from the members that kept
   their own), so the launch gets the answer of its own frozen sets, never the final
   answer of an older launch, and all its ranks get the same one (rule 2).
7. **Freezes go forward.** A rank's request never freezes a generation below one this
   node froze or resolved (`check_request`): it comes from a launch that a newer one
   superseded (a rank of a dead launch whose request arrives late). Its frozen set
   could copy epochs of other members' sets (rule 1) that their closing, once the
   newer generation resolves, stops protecting, while our record of it is still on
   its way: other nodes could then delete epochs of a set that is open here (S4).
   Facts already in the log (replay, adoption after a lost state) are not requests
   and are applied as they are.
8. **A generation belongs to one membership.** A spec's ``membership`` is the first
   generation its member map applies to. A generation resolves over the frozen sets
   of the members of the spec it was frozen under, in records with that spec's
   digest; after a membership change, a generation below the new membership can no
   longer be requested (refused, as closed) nor resolve here, but its frozen set
   stays open and protects its epochs until a newer generation resolves (rule 4).

The table `TRANSITIONS` is the whole state machine; `Generations` holds the frozen
sets and answers of one stream and fires the transitions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from convergenced.core.errors import FactError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.limits import MAX_GENERATIONS
from convergenced.core.validate import INT64_MAX


class GenerationState(Enum):
    """Where one recovery generation stands on this node."""

    UNKNOWN = "unknown"
    """Never requested here, and not closed."""
    FROZEN = "frozen"
    """Our frozen set is durable and published; some member's set is still unknown."""
    RESOLVED = "resolved"
    """Every member's frozen set is known: the answer is final."""
    CLOSED = "closed"
    """Superseded by a newer resolved generation (or evicted): protects nothing."""


class GenEv(Enum):
    """Events of the lifecycle."""

    FREEZE = "freeze"
    RESOLVE = "resolve"
    CLOSE = "close"


G = GenerationState
TRANSITIONS: dict[GenerationState, dict[GenEv, GenerationState]] = {
    G.UNKNOWN: {GenEv.FREEZE: G.FROZEN, GenEv.CLOSE: G.CLOSED},
    G.FROZEN: {GenEv.RESOLVE: G.RESOLVED, GenEv.CLOSE: G.CLOSED},
    G.RESOLVED: {GenEv.CLOSE: G.CLOSED},
    G.CLOSED: {},
}
"""``TRANSITIONS[state][event] -> next state``; anything absent is illegal."""


class GenerationClosedError(FactError):
    """The generation was superseded by a newer one that is already resolved."""

    def __init__(
        self,
        stream: str,
        generation: int,
        closed_below: int,
        newer: int | None = None,
        membership: int | None = None,
    ) -> None:
        if membership is not None:
            why = f"a new member map applies from generation {membership} on"
        elif newer is None:
            why = f"generation {closed_below} or newer is resolved"
        else:
            why = f"this node froze generation {newer} for a newer launch"
        super().__init__(
            f"stream {stream!r}: generation {generation} is closed ({why}); a relaunch "
            "asks for a new generation (next_generation) instead of reusing a launcher's "
            "counter",
            reason="generation_closed",
        )
        self.generation = generation
        self.closed_below = closed_below


class GenerationsExhaustedError(FactError):
    """No generation number is left above the highest one known (2^63 - 1)."""

    def __init__(self, stream: str) -> None:
        super().__init__(
            f"stream {stream!r}: generation {INT64_MAX} is known, no newer one is left; "
            "declare a new stream",
            reason="generations_exhausted",
        )


class MembershipSupersededError(FactError):
    """A declaration's membership is not above what this node (or a member) already
    froze, resolved or declared: it comes from a launch a newer one superseded."""

    def __init__(self, stream: str, membership: int, newest: int, who: str = "this node") -> None:
        super().__init__(
            f"stream {stream!r}: membership {membership} is not above generation {newest} "
            f"that {who} already froze, resolved or declared a member map for; a relaunch "
            "with a new member map declares membership = the generation next_generation "
            "gave it",
            reason="membership_superseded",
        )
        self.membership = membership
        self.newest = newest


@dataclass(frozen=True, slots=True)
class GenerationAnswer:
    """The restore point of a recovery generation, or what it still waits for."""

    generation: int
    resolved: bool
    restore_point: int | None
    """Final once resolved (None: the frozen sets have no common epoch)."""
    waiting_for: tuple[str, ...]
    """Members whose frozen set is not known yet."""
    lost: bool = False
    """The resolved epoch has since been retracted: open a newer generation."""


def resolve(
    member_sets: Iterable[tuple[str, IntervalSet | None]],
) -> tuple[bool, int | None, tuple[str, ...]]:
    """Rule 2 over every member's frozen set (None: not known yet).

    Returns (resolved, answer, members still waited for).
    """
    known: list[IntervalSet] = []
    waiting: list[str] = []
    for member, frozen in member_sets:
        if frozen is None:
            waiting.append(member)
        else:
            known.append(frozen)
    if waiting:
        return False, None, tuple(waiting)
    return True, IntervalSet.intersect_all(known).max(), ()


def next_generation(
    own: Generations, published: Iterable[int], memberships: Iterable[int] = ()
) -> int:
    """Rule 6: the generation a new launch uses, given ``published``, the generation
    numbers in the members' records, and ``memberships``, the memberships declared
    here and in them.

    Above every generation of ``own`` (open, resolved here, closed or taken), every
    one published and every membership declared (rule 8: so the launch may declare a
    new member map from it on); 0 when none is known.

    Raises:
        GenerationsExhaustedError: generation 2^63 - 1 is known already.
    """
    top = max([*own.frozen, *own.answers, *published, *memberships, own.taken_below - 1])
    if top >= INT64_MAX:
        raise GenerationsExhaustedError(own.stream)
    return max(own.closed_below, top + 1)


@dataclass(slots=True)
class Generations:
    """The recovery generations of one stream on this node."""

    stream: str
    frozen: dict[int, IntervalSet] = field(default_factory=dict)
    """Frozen sets of the open generations (FROZEN or RESOLVED): durable facts."""
    closed_below: int = 0
    """Every generation below this is CLOSED (a durable fact)."""
    answers: dict[int, int | None] = field(default_factory=dict)
    """Answers of the generations resolved by this process (kept after closing)."""
    membership: int = 0
    """The stream's current membership (rule 8): generations below it were frozen
    under an older member map and never resolve here."""
    taken_below: int = 0
    """Generations below this may be resolved somewhere, though this node knows
    nothing of them: the members' records showed them when it settled the stream
    after losing its state (`lives`, rule 4; a durable fact, `Settled`). A relaunch
    is numbered above them (rule 6); nothing else changes."""

    def state(self, generation: int) -> GenerationState:
        """The state of ``generation`` (see `GenerationState`)."""
        if generation < self.closed_below:
            return G.CLOSED
        if generation in self.answers:
            return G.RESOLVED
        if generation in self.frozen:
            return G.FROZEN
        return G.UNKNOWN

    def _fire(self, generation: int, event: GenEv) -> GenerationState:
        state = self.state(generation)
        nxt = TRANSITIONS[state].get(event)
        if nxt is None:
            if state is G.CLOSED:
                raise GenerationClosedError(self.stream, generation, self.closed_below)
            raise AssertionError(f"generation {generation}: {event.value} in state {state.value}")
        return nxt

    # -- checks (never change anything) -----------------------------------------

    def check_answerable(self, generation: int) -> None:
        """Raise `GenerationClosedError` unless a request for ``generation`` can be
        answered (rule 5: a closed generation answers only if it resolved here; rule 8:
        nor does one of an older membership)."""
        if generation in self.answers:
            return
        if self.state(generation) is G.CLOSED:
            raise GenerationClosedError(self.stream, generation, self.closed_below)
        if generation < self.membership:
            raise GenerationClosedError(
                self.stream, generation, self.closed_below, membership=self.membership
            )

    def check_freeze(self, generation: int) -> None:
        """Raise `GenerationClosedError` if ``generation`` may no longer be frozen."""
        if self.state(generation) is G.CLOSED:
            raise GenerationClosedError(self.stream, generation, self.closed_below)

    def needs_freeze(self, generation: int) -> bool:
        """Whether a request for ``generation`` must freeze our set first (rule 1).

        Raises:
            GenerationClosedError: the generation is closed.
        """
        self.check_freeze(generation)
        return self.state(generation) is G.UNKNOWN

    def check_request(self, generation: int) -> None:
        """Raise `GenerationClosedError` if a rank's request may not freeze
        ``generation``: it is closed, or (rule 7) this node has not frozen it but froze
        or resolved a newer one, or (rule 8) it belongs to an older membership."""
        self.check_freeze(generation)
        if generation < self.membership:
            raise GenerationClosedError(
                self.stream, generation, self.closed_below, membership=self.membership
            )
        newest = max([*self.frozen, *self.answers], default=-1)
        if generation not in self.frozen and generation < newest:
            raise GenerationClosedError(self.stream, generation, self.closed_below, newest)

    # -- transitions ----------------------------------------------------------------

    def freeze(self, generation: int, epochs: IntervalSet) -> None:
        """Take our (durable) frozen set of ``generation``; a repeat is ignored.

        Raises:
            GenerationClosedError: the generation is closed.
        """
        if not self.needs_freeze(generation):
            return  # frozen already: the first set stays
        self._fire(generation, GenEv.FREEZE)
        self.frozen[generation] = epochs
        while len(self.frozen) > MAX_GENERATIONS:
            # Evicting closes it: re-freezing it later could give another set.
            self.close_below(min(self.frozen) + 1)

    def resolve(self, generation: int, answer: int | None) -> None:
        """Record the final answer of a FROZEN generation (rule 2)."""
        self._fire(generation, GenEv.RESOLVE)
        self.answers[generation] = answer

    def take_below(self, below: int) -> None:
        """Keep every generation below ``below`` as taken (see `taken_below`)."""
        self.taken_below = max(self.taken_below, below)

    def close_below(self, below: int) -> bool:
        """Close every generation below ``below`` (rule 4); return whether any changed."""
        if below <= self.closed_below:
            return False
        for g in [g for g in self.frozen if g < below]:
            self._fire(g, GenEv.CLOSE)
            del self.frozen[g]
        self.closed_below = below
        return True

    # -- queries ----------------------------------------------------------------------

    def newest_frozen(self) -> int | None:
        """The newest generation frozen here and still open (None: none).

        The newest one frozen is never closed by a newer one resolving, nor evicted
        while it is the newest, so this is also the newest ever frozen here.
        """
        return max(self.frozen) if self.frozen else None

    def unresolved(self) -> list[int]:
        """Open generations of the current membership still waiting for some member's
        frozen set (rule 8: older ones never resolve here)."""
        return sorted(g for g in self.frozen if g not in self.answers and g >= self.membership)

    def check_membership(self, membership: int) -> None:
        """Raise `MembershipSupersededError` unless a member map may apply from
        generation ``membership`` on: above every generation frozen or resolved here
        (those were frozen under the member map in force) and not closed."""
        newest = max([*self.frozen, *self.answers, self.closed_below - 1, self.membership],
                     default=-1)  # fmt: skip
        if membership <= newest:
            raise MembershipSupersededError(self.stream, membership, newest)

    def open_sets(self) -> tuple[tuple[int, IntervalSet], ...]:
        """(generation, frozen set) of every open generation, oldest first: what our
        record publishes and what protects epochs from garbage collection."""
        return tuple(sorted(self.frozen.items()))
