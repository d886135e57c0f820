"""Requests for recovery generations: freezing, answering, resolving, numbering.

`NodeCore`'s part of `generations` (a mixin: it works on the node's state). The rules
themselves, and the lifecycle table, live in `generations`; this module applies them
to the node's view: which frozen sets of the members count (those in records of the
spec the generation belongs to), what a new launch's number is, and when a
generation resolves.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from convergenced.core.events import GenerationResolved, NodeEvent
from convergenced.core.facts import CloseGenerations, Fact, Freeze
from convergenced.core.generations import (
    GenerationAnswer,
    Generations,
    next_generation,
    resolve,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.limits import MAX_RANGES
from convergenced.core.lives import PastLives
from convergenced.core.records import View
from convergenced.core.stream_state import StreamState


class GenerationRequests:
    """`NodeCore`'s generation requests (see the module docstring)."""

    node_id: str
    view: View
    _streams: dict[str, StreamState]
    _lives: PastLives
    _pending_facts: list[Fact]
    _events: deque[NodeEvent]
    _declared: dict[str, IntervalSet]  # NodeCore's: every safe_to_delete answer

    _stream: Callable[[str], StreamState]  # NodeCore's
    generations_closed_below: Callable[[str], int]  # Declarations'
    waiting_to_freeze: Callable[[str], tuple[str, ...]]  # EarlierLives'

    def freeze_fact(self, stream: str, generation: int) -> Freeze | None:
        """The `Freeze` fact to persist for our first request of ``generation``.

        Returns None when we froze that generation already. The frozen set holds
        recoverable epochs at or above the highest GC horizon this node computed
        (`facts.Horizon`; its high-water mark minus the retention when it knows
        none), and those in the frozen set another member already published for this
        generation (`generations`, rule 1), minus every epoch this node ever declared
        safe to delete (`safe_to_delete`; after a restart, all below that horizon): a
        rank may be deleting those. A member that asks later, while the restore point
        moved on, still shares the epochs the earlier ones froze.

        Raises:
            UnknownStreamError: the stream is not declared here.
            GenerationClosedError: a newer generation is already resolved, or this
                node froze a newer one (`generations`, rule 7).
        """
        st = self._stream(stream)
        if not st.generations.needs_freeze(generation) or not st.settled:
            return None
        st.generations.check_request(generation)
        recoverable = st.facts.recoverable
        hw = st.facts.high_water
        if hw is None:
            return Freeze(stream, generation, recoverable.newest_ranges(MAX_RANGES))
        # Nothing at or above the highest horizon we computed was ever declared safe
        # to delete here; every horizon is at most hw - retention (`agreement`).
        horizon = st.facts.horizon
        floor = horizon if horizon is not None else hw - st.facts.spec.retention
        others = [s for m, s in self._frozen_sets(st, generation) if m != self.node_id and s]
        epochs = recoverable.at_least(floor) | (recoverable & IntervalSet.union_all(others))
        # Another member's set may reach below what our horizon passed before it
        # arrived (its own horizon lagged ours): we may have declared those epochs
        # safe, and our ranks may be deleting them (S4, S1).
        epochs -= self._declared.get(stream, IntervalSet())
        return Freeze(stream, generation, epochs.newest_ranges(MAX_RANGES))

    def next_generation(self, stream: str) -> int | None:
        """The recovery generation a new launch of ``stream`` uses (`generations`, rule 6).

        Above every generation this node froze, resolved or closed and every one in
        its members' records, so no member has resolved it: one rank of the launch
        asks, and hands the number to the others. Asking changes nothing; asking
        again before anyone froze it gives the same number. None until this node,
        started without a log, has heard from its members (`waiting_to_freeze`):
        before that it may not know of generations its lost state froze.

        Raises:
            UnknownStreamError: the stream is not declared here.
            GenerationsExhaustedError: generation 2^63 - 1 is known already.
        """
        st = self._streams.get(stream)
        records = [r for o, r in self.view.stream(stream).items() if o != self.node_id]
        if st is None:
            # Not declared here (a spare about to take over ranks): answer from the
            # records of every origin, once this node knows its past.
            lives = self._lives
            if lives.unsure and (not lives.heard or self.waiting_to_freeze(stream)):
                return None
            own = Generations(stream, closed_below=self.generations_closed_below(stream))
        elif not st.settled:
            return None
        else:
            own = st.generations
        # Every record of the stream counts, whatever its spec or membership: a
        # higher number is always safe, a lower one could be resolved already.
        published = [g for rec in records for g, _ in rec.generations]
        declared = [rec.membership for rec in records]
        if st is not None:
            declared.append(st.facts.spec.membership)
        return next_generation(own, published, declared)

    def generation(self, stream: str, generation: int) -> GenerationAnswer:
        """The answer for ``generation``: resolved, or whom it still waits for.

        Freeze it first (`freeze_fact`); asking never changes anything (resolution
        happens as the inputs arrive, see `generations`).

        Raises:
            UnknownStreamError: the stream is not declared here.
            GenerationClosedError: the generation is closed and never resolved here.
        """
        st = self._stream(stream)
        gens = st.generations
        gens.check_answerable(generation)
        if generation in gens.answers:
            rp = gens.answers[generation]
            ci = st.decision.convergence if st.decision else None
            lost = rp is not None and ci is not None and rp not in ci
            return GenerationAnswer(generation, True, rp, (), lost)
        _, _, waiting = resolve(self._frozen_sets(st, generation))
        return GenerationAnswer(generation, False, None, waiting)

    def _frozen_sets(
        self, st: StreamState, generation: int
    ) -> Iterator[tuple[str, IntervalSet | None]]:
        """Every member's frozen set of ``generation`` as we know it (None: unknown)."""
        records = self.view.stream(st.facts.spec.name)
        digest = st.agreement.digest
        for member in st.facts.spec.member_ids:
            if member == self.node_id:
                yield member, st.generations.frozen.get(generation)
                continue
            rec = records.get(member)
            ok = rec is not None and rec.spec_digest == digest
            yield member, rec.generation(generation) if rec is not None and ok else None

    def _resolve_ready(self, st: StreamState) -> None:
        """Resolve our open generations whose last frozen set just became known."""
        name = st.facts.spec.name
        for g in st.generations.unresolved():
            done, rp, _ = resolve(self._frozen_sets(st, g))
            if not done:
                continue
            st.generations.resolve(g, rp)
            self._events.append(GenerationResolved(name, g, rp))
            # A resolved generation supersedes older ones: they stop protecting epochs.
            if st.generations.close_below(g):
                self._pending_facts.append(CloseGenerations(name, g))
