"""The recovery-generation lifecycle: one table, its rules, and what it refuses."""

from __future__ import annotations

import pytest

from convergenced.core.generations import (
    TRANSITIONS,
    GenerationClosedError,
    Generations,
    GenerationState,
    GenEv,
    resolve,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.records import MAX_GENERATIONS

S = GenerationState


def test_the_table_only_moves_forward_and_closed_is_final() -> None:
    order = [S.UNKNOWN, S.FROZEN, S.RESOLVED, S.CLOSED]
    for state, moves in TRANSITIONS.items():
        for nxt in moves.values():
            assert order.index(nxt) > order.index(state)
    assert TRANSITIONS[S.CLOSED] == {}
    assert all(GenEv.CLOSE in TRANSITIONS[s] for s in (S.UNKNOWN, S.FROZEN, S.RESOLVED))


def test_a_generation_is_frozen_once_resolved_once_and_answers_after_closing() -> None:
    g = Generations("job")
    assert g.needs_freeze(1)
    g.freeze(1, IntervalSet.span(1, 5))
    g.freeze(1, IntervalSet.span(1, 9))  # a second request: the first set stays
    assert g.frozen[1] == IntervalSet.span(1, 5) and g.state(1) is S.FROZEN
    assert not g.needs_freeze(1)
    g.resolve(1, 5)
    assert g.state(1) is S.RESOLVED
    g.freeze(2, IntervalSet.of(6))
    g.resolve(2, 6)
    assert g.close_below(2)
    assert g.state(1) is S.CLOSED and g.open_sets() == ((2, IntervalSet.of(6)),)
    g.check_answerable(1)  # resolved here: its answer stays final
    with pytest.raises(GenerationClosedError):
        g.check_freeze(1)


def test_a_closed_generation_that_never_resolved_here_is_refused() -> None:
    g = Generations("job")
    g.freeze(1, IntervalSet.of(3))
    g.close_below(3)
    for generation in (1, 2):
        with pytest.raises(GenerationClosedError) as info:
            g.check_answerable(generation)
        assert info.value.reason == "generation_closed"
    with pytest.raises(GenerationClosedError):
        g.freeze(2, IntervalSet.of(3))
    assert g.unresolved() == []


def test_freezing_past_the_limit_closes_the_oldest() -> None:
    g = Generations("job")
    for n in range(1, MAX_GENERATIONS + 2):
        g.freeze(n, IntervalSet.of(n))
    assert len(g.frozen) == MAX_GENERATIONS
    assert g.state(1) is S.CLOSED and g.closed_below == 2


def test_resolution_waits_for_every_member_and_takes_the_newest_common_epoch() -> None:
    sets = [("a", IntervalSet.span(1, 5)), ("b", None), ("c", IntervalSet.span(3, 9))]
    assert resolve(sets) == (False, None, ("b",))
    sets[1] = ("b", IntervalSet.of(2, 4))
    assert resolve(sets) == (True, 4, ())
    assert resolve([("a", IntervalSet.of(1)), ("b", IntervalSet.of(2))]) == (True, None, ())
