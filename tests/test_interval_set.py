"""IntervalSet behaves exactly like a Python set of epochs, in a canonical normal form.

Every operation is checked against a plain ``set[int]`` model on random sets built
from random (overlapping, adjacent, unordered) ranges, and every result is checked
to be in normal form: sorted, ``lo <= hi``, and separated by a gap of at least one
epoch, which is what makes equality structural and the encoding canonical.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.interval_set import MAX_EPOCH, IntervalSet

PROPERTY = settings(max_examples=100, deadline=None)
TOP = 90
"""Epochs in the random sets stay below this, so the model stays small."""

Pair = tuple[IntervalSet, set[int]]


def _range_lists() -> st.SearchStrategy[list[tuple[int, int]]]:
    starts = st.integers(0, TOP - 12)
    return st.lists(
        st.tuples(starts, st.integers(0, 11)).map(lambda t: (t[0], t[0] + t[1])), max_size=8
    )


def _model(ranges: list[tuple[int, int]]) -> set[int]:
    return {e for lo, hi in ranges for e in range(lo, hi + 1)}


@st.composite
def sets(draw: st.DrawFn) -> Pair:
    """An IntervalSet and its model, built from ranges in arbitrary order."""
    ranges = draw(_range_lists())
    return IntervalSet(ranges), _model(ranges)


def assert_normal(s: IntervalSet) -> None:
    ranges = s.ranges
    for lo, hi in ranges:
        assert 0 <= lo <= hi <= MAX_EPOCH
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert lo > hi + 1, f"ranges not separated by a gap: {ranges}"


def assert_models(s: IntervalSet, model: set[int]) -> None:
    assert_normal(s)
    assert set(s) == model
    assert list(s) == sorted(model)
    assert len(s) == len(model)
    assert bool(s) == bool(model)


epochs = st.integers(-3, TOP + 3)


# -- construction and normal form ---------------------------------------------


@PROPERTY
@given(sets())
def test_construction_from_ranges_holds_exactly_their_epochs(pair: Pair) -> None:
    s, model = pair
    assert_models(s, model)


@PROPERTY
@given(_range_lists(), st.randoms(use_true_random=False))
def test_construction_is_independent_of_range_order(
    ranges: list[tuple[int, int]], rnd: Any
) -> None:
    shuffled = list(ranges)
    rnd.shuffle(shuffled)
    assert IntervalSet(shuffled) == IntervalSet(ranges)
    assert IntervalSet(shuffled).ranges == IntervalSet(ranges).ranges


@PROPERTY
@given(st.lists(st.integers(0, TOP), max_size=30))
def test_of_holds_exactly_the_given_epochs(items: list[int]) -> None:
    assert_models(IntervalSet.of(*items), set(items))


def test_adjacent_ranges_merge_into_one() -> None:
    assert IntervalSet([(5, 7), (0, 2), (3, 4)]).ranges == ((0, 7),)


def test_ranges_with_a_gap_stay_apart() -> None:
    assert IntervalSet([(0, 2), (4, 5)]).ranges == ((0, 2), (4, 5))


def test_contained_range_is_absorbed() -> None:
    assert IntervalSet([(0, 10), (3, 4)]).ranges == ((0, 10),)


def test_span_is_inclusive_and_empty_when_reversed() -> None:
    assert list(IntervalSet.span(3, 5)) == [3, 4, 5]
    assert IntervalSet.span(5, 3) == IntervalSet()
    assert not IntervalSet.span(1, 0)


@pytest.mark.parametrize("bad", [(3, 2), (-1, 4), (0, MAX_EPOCH + 1), (-5, -1)])
def test_construction_rejects_invalid_ranges(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="invalid epoch range"):
        IntervalSet([(0, 1), bad])


def test_epochs_up_to_max_epoch_are_supported() -> None:
    s = IntervalSet.span(MAX_EPOCH - 2, MAX_EPOCH)
    assert len(s) == 3
    assert s.max() == MAX_EPOCH
    assert MAX_EPOCH in s
    assert s.at_least(MAX_EPOCH) == IntervalSet.of(MAX_EPOCH)
    assert s.below(MAX_EPOCH) == IntervalSet.span(MAX_EPOCH - 2, MAX_EPOCH - 1)


# -- single epochs ------------------------------------------------------------


@PROPERTY
@given(sets(), epochs.filter(lambda e: e >= 0))
def test_add_matches_adding_to_the_model(pair: Pair, e: int) -> None:
    s, model = pair
    assert_models(s.add(e), model | {e})


@PROPERTY
@given(sets(), epochs)
def test_remove_matches_removing_from_the_model(pair: Pair, e: int) -> None:
    s, model = pair
    assert_models(s.remove(e), model - {e})


@PROPERTY
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=60))
def test_a_run_of_adds_and_removes_matches_the_model(steps: list[tuple[bool, int]]) -> None:
    s, model = IntervalSet(), set()
    for adding, e in steps:
        s = s.add(e) if adding else s.remove(e)
        if adding:
            model.add(e)
        else:
            model.discard(e)
        assert_models(s, model)


@PROPERTY
@given(sets(), epochs.filter(lambda e: e >= 0))
def test_add_and_remove_return_the_same_set_when_nothing_changes(pair: Pair, e: int) -> None:
    s, model = pair
    if e in model:
        assert s.add(e) is s
    else:
        assert s.remove(e) is s


@pytest.mark.parametrize("bad", [-1, MAX_EPOCH + 1])
def test_add_rejects_an_epoch_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError):
        IntervalSet.of(3).add(bad)


def test_add_and_remove_work_at_the_top_of_the_epoch_range() -> None:
    s = IntervalSet.of(MAX_EPOCH - 1).add(MAX_EPOCH)
    assert s.ranges == ((MAX_EPOCH - 1, MAX_EPOCH),)
    assert s.remove(MAX_EPOCH) == IntervalSet.of(MAX_EPOCH - 1)


# -- equality and hashing -----------------------------------------------------


@PROPERTY
@given(sets(), sets())
def test_equality_is_set_equality_and_hash_agrees(a: Pair, b: Pair) -> None:
    assert (a[0] == b[0]) == (a[1] == b[1])
    if a[0] == b[0]:
        assert hash(a[0]) == hash(b[0])
        assert a[0].ranges == b[0].ranges


def test_interval_set_is_never_equal_to_other_types() -> None:
    assert IntervalSet.of(1, 2) != {1, 2}
    assert IntervalSet() != ()


# -- algebra ------------------------------------------------------------------


@PROPERTY
@given(sets(), sets())
def test_union_matches_set_union(a: Pair, b: Pair) -> None:
    assert_models(a[0].union(b[0]), a[1] | b[1])
    assert_models(a[0] | b[0], a[1] | b[1])


@PROPERTY
@given(sets(), sets())
def test_intersection_matches_set_intersection(a: Pair, b: Pair) -> None:
    assert_models(a[0].intersection(b[0]), a[1] & b[1])
    assert_models(a[0] & b[0], a[1] & b[1])


@PROPERTY
@given(sets(), sets())
def test_difference_matches_set_difference(a: Pair, b: Pair) -> None:
    assert_models(a[0].difference(b[0]), a[1] - b[1])
    assert_models(a[0] - b[0], a[1] - b[1])


@PROPERTY
@given(st.lists(sets(), min_size=1, max_size=5))
def test_intersect_all_matches_intersection_of_all(pairs: list[Pair]) -> None:
    expected = set.intersection(*(m for _, m in pairs))
    assert_models(IntervalSet.intersect_all([s for s, _ in pairs]), expected)


@PROPERTY
@given(st.lists(sets(), max_size=5))
def test_union_all_matches_union_of_all(pairs: list[Pair]) -> None:
    expected: set[int] = set().union(*(m for _, m in pairs))
    assert_models(IntervalSet.union_all(s for s, _ in pairs), expected)


def test_intersect_all_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError):
        IntervalSet.intersect_all([])


@PROPERTY
@given(sets(), sets(), sets())
def test_algebra_laws_hold(a: Pair, b: Pair, c: Pair) -> None:
    x, y, z = a[0], b[0], c[0]
    assert x | y == y | x
    assert x & y == y & x
    assert (x | y) | z == x | (y | z)
    assert (x & y) & z == x & (y & z)
    assert x & (y | z) == (x & y) | (x & z)
    assert (x - y) | (x & y) == x
    assert not ((x - y) & y)


# -- inspection ---------------------------------------------------------------


@PROPERTY
@given(sets(), epochs)
def test_membership_matches_the_model(pair: Pair, e: int) -> None:
    s, model = pair
    assert (e in s) == (e in model)


def test_membership_of_non_integers_is_false() -> None:
    s = IntervalSet.span(0, 10)
    assert "3" not in s
    assert 3.0 not in s
    assert None not in s


@PROPERTY
@given(sets())
def test_min_and_max_match_the_model(pair: Pair) -> None:
    s, model = pair
    assert s.min() == (min(model) if model else None)
    assert s.max() == (max(model) if model else None)


@PROPERTY
@given(sets(), epochs)
def test_max_at_most_is_the_largest_epoch_not_above_the_bound(pair: Pair, bound: int) -> None:
    s, model = pair
    assert s.max_at_most(bound) == max((e for e in model if e <= bound), default=None)


@PROPERTY
@given(sets(), epochs)
def test_below_keeps_epochs_strictly_under_the_bound(pair: Pair, bound: int) -> None:
    s, model = pair
    assert_models(s.below(bound), {e for e in model if e < bound})


@PROPERTY
@given(sets(), epochs)
def test_at_least_keeps_epochs_at_or_over_the_bound(pair: Pair, bound: int) -> None:
    s, model = pair
    assert_models(s.at_least(bound), {e for e in model if e >= bound})


@PROPERTY
@given(sets(), st.integers(MAX_EPOCH - 1, 2**70))
def test_below_a_bound_beyond_the_epoch_range_keeps_everything(pair: Pair, bound: int) -> None:
    s, _ = pair
    assert s.below(bound) == s
    assert s.at_least(bound) == IntervalSet()


@PROPERTY
@given(sets(), st.integers(-(2**70), -1))
def test_negative_bounds_select_everything_or_nothing(pair: Pair, bound: int) -> None:
    s, _ = pair
    assert s.below(bound) == IntervalSet()
    assert s.at_least(bound) == s
    assert s.max_at_most(bound) is None


# -- encoding -----------------------------------------------------------------


@PROPERTY
@given(sets())
def test_encode_is_the_flat_list_of_range_bounds(pair: Pair) -> None:
    s, _ = pair
    flat = s.encode()
    assert flat == [b for r in s.ranges for b in r]
    assert all(type(b) is int for b in flat)


@PROPERTY
@given(sets())
def test_decode_inverts_encode(pair: Pair) -> None:
    s, model = pair
    back = IntervalSet.decode(s.encode())
    assert back == s
    assert_models(back, model)


def _is_canonical(flat: list[int]) -> bool:
    """Whether ``flat`` is what `encode` gives for the set its pairs describe."""
    if len(flat) % 2:
        return False
    try:
        normal = IntervalSet(zip(flat[::2], flat[1::2], strict=True))
    except ValueError:
        return False
    return normal.encode() == flat


@PROPERTY
@given(st.lists(st.integers(-2, 30), max_size=8))
def test_decode_accepts_only_canonical_encodings(flat: list[int]) -> None:
    if _is_canonical(flat):
        assert IntervalSet.decode(flat).encode() == flat
    else:
        with pytest.raises(ValueError):
            IntervalSet.decode(flat)


@pytest.mark.parametrize(
    "flat",
    [
        [1],
        [0, 1, 2],
        [-1, 3],
        [3, 2],
        [0, MAX_EPOCH + 1],
        [5, 6, 0, 1],
        [0, 4, 2, 8],
        [0, 4, 4, 8],
        [0, 4, 5, 8],
        [0.0, 1],
        [0, 1.5],
        [False, True],
        ["0", "1"],
        [None, 1],
    ],
    ids=repr,
)
def test_decode_rejects_non_normal_input(flat: list[Any]) -> None:
    with pytest.raises(ValueError):
        IntervalSet.decode(flat)


def test_decode_of_nothing_is_the_empty_set() -> None:
    assert IntervalSet.decode([]) == IntervalSet()


def test_repr_lists_ranges_and_singletons() -> None:
    assert repr(IntervalSet([(0, 3), (7, 7)])) == "IntervalSet{0-3, 7}"
