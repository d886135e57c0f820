"""What a node's ranks store, per domain (`StreamFacts.stored`): the sizes of the epochs
they hold, committed and neither retracted nor retired, and how many epochs.

The bytes are kept summed as facts apply, never recounted; these tests hold the running
sum to a recount of the held contents after any sequence of facts, a log compaction
and its replay, and a move to a new member map.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import FactError
from convergenced.core.facts import (
    Commit,
    EpochFact,
    Retire,
    Retract,
    Stored,
    StreamFacts,
)
from convergenced.core.spec import Policy, StreamSpec

PROPERTY = settings(max_examples=200, deadline=None)
DOMAINS = ("nvme", "s3")


def make_spec(membership: int = 0, members: dict[str, list[int]] | None = None) -> StreamSpec:
    return StreamSpec.create(
        "job", members or {"a": [0, 1], "b": [2]}, Policy.any_of(*DOMAINS), 0,
        shared=("s3",), membership=membership,
    )  # fmt: skip


def recount(f: StreamFacts) -> dict[str, Stored]:
    """What `stored` must say, counted the slow way from the held epochs."""
    out = {}
    for d in DOMAINS:
        held = [(r, e) for r in f.ranks for e in f.available.get((r, d), ())]
        size = sum(c.size for r, e in held if (c := f.content(r, d, e)) is not None)
        out[d] = Stored(size, len({e for _, e in held}))
    return out


def test_sizes_of_held_epochs_add_up_per_domain() -> None:
    f = StreamFacts(make_spec(), "a")
    for fact in (
        Commit("job", 0, "nvme", 1, "sha256:aa", 100),
        Commit("job", 1, "nvme", 1, "sha256:bb", 150),
        Commit("job", 0, "nvme", 2, "sha256:cc", 120),
        Commit("job", 0, "s3", 1, "sha256:aa", 100),
        Commit("job", 1, "s3", 3),  # no size stated: held, counts 0 bytes
    ):
        f.apply(fact)
    assert f.stored() == {"nvme": Stored(370, 2), "s3": Stored(100, 2)}


def test_retracted_and_retired_epochs_no_longer_count() -> None:
    f = StreamFacts(make_spec(), "a")
    for fact in (
        Commit("job", 0, "nvme", 1, "", 100),
        Commit("job", 1, "nvme", 1, "", 150),
        Commit("job", 0, "nvme", 2, "", 120),
        Commit("job", 0, "s3", 2, "", 120),
    ):
        f.apply(fact)
    f.apply(Retract("job", 0, "nvme", 2))
    assert f.stored()["nvme"] == Stored(250, 1)
    f.apply(Retire("job", 0, "nvme", 1))
    assert f.stored()["nvme"] == Stored(150, 1)
    f.apply(Retire("job", 1, "nvme", 1))
    assert f.stored() == {"nvme": Stored(0, 0), "s3": Stored(120, 1)}


def test_a_commit_sent_again_with_another_size_replaces_its_size() -> None:
    f = StreamFacts(make_spec(), "a")
    f.apply(Commit("job", 0, "nvme", 1, "", 100))
    f.apply(Commit("job", 0, "nvme", 1, "", 100))  # the same again: not counted twice
    assert f.stored()["nvme"] == Stored(100, 1)
    f.apply(Commit("job", 0, "nvme", 1, "", 300))  # `commits` decides which are admitted
    assert f.stored()["nvme"] == Stored(300, 1)
    f.apply(Commit("job", 0, "nvme", 1))  # again without a size: held, 0 bytes
    assert f.stored()["nvme"] == Stored(0, 1)


def test_every_policy_domain_is_reported_and_only_those() -> None:
    f = StreamFacts(make_spec(), "a")
    assert f.stored() == {"nvme": Stored(0, 0), "s3": Stored(0, 0)}


ranks = st.sampled_from([0, 1])
domains = st.sampled_from(DOMAINS)
epochs = st.integers(0, 6)
sizes = st.sampled_from([0, 1, 7, 2**40, 2**62])
facts_st = st.one_of(
    st.builds(lambda r, d, e, s: Commit("job", r, d, e, "", s), ranks, domains, epochs, sizes),
    st.builds(lambda r, d, e: Retract("job", r, d, e), ranks, domains, epochs),
    st.builds(lambda r, d, e: Retire("job", r, d, e), ranks, domains, epochs),
)


def _apply_all(f: StreamFacts, facts: list[EpochFact]) -> None:
    for fact in facts:
        try:
            f.apply(fact)
        except FactError as exc:
            assert exc.reason == "retired", exc  # a commit of a retired epoch: no change


@PROPERTY
@given(st.lists(facts_st, max_size=40))
def test_the_running_sum_is_the_recount_after_any_facts(facts: list[EpochFact]) -> None:
    f = StreamFacts(make_spec(), "a")
    _apply_all(f, facts)
    assert f.stored() == recount(f)


@PROPERTY
@given(st.lists(facts_st, max_size=40))
def test_a_compacted_log_replayed_stores_the_same(facts: list[EpochFact]) -> None:
    f = StreamFacts(make_spec(), "a")
    _apply_all(f, facts)
    again = StreamFacts(make_spec(), "a")
    for state in f.compacted():
        again.restore_rank(state)
    for _, c in f.content_commits():
        again.apply(c)
    assert again.stored() == f.stored()
    # Compaction over a node that already holds the contents (a second compaction's
    # states applied on top) forgets and restores them without counting them twice.
    for state in f.compacted():
        again.restore_rank(state)
    for _, c in f.content_commits():
        again.apply(c)
    assert again.stored() == f.stored() == recount(again)


@PROPERTY
@given(st.lists(facts_st, max_size=40))
def test_ranks_moved_away_take_their_bytes_with_them(facts: list[EpochFact]) -> None:
    f = StreamFacts(make_spec(), "a")
    _apply_all(f, facts)
    kept = {d: sum(c.size for c in f.contents.get((0, d), {}).values()) for d in DOMAINS}
    f.rehost(make_spec(1, {"a": [0], "b": [1, 2]}))
    assert f.stored() == recount(f)
    assert {d: s.bytes for d, s in f.stored().items()} == kept
