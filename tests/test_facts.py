"""Local facts and the recoverable set E(n) they imply, and refusals that change nothing."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pulled import clear_events, clear_facts, events, pending_facts

from convergenced.core.errors import FactError, UnknownStreamError
from convergenced.core.facts import (
    Commit,
    Declare,
    EpochFact,
    Fact,
    Freeze,
    HighWater,
    Retire,
    Retract,
    StreamFacts,
)
from convergenced.core.interval_set import MAX_EPOCH, IntervalSet
from convergenced.core.node import GenerationClosedError, NodeCore
from convergenced.core.spec import Policy, PolicyMode, StreamSpec

PROPERTY = settings(max_examples=150, deadline=None)
RANKS_A = (0, 1)


def make_spec(policy: Policy, retention: int = 0) -> StreamSpec:
    return StreamSpec.create("job", {"a": list(RANKS_A), "b": [2]}, policy, retention)


def facts(policy: Policy) -> StreamFacts:
    return StreamFacts(make_spec(policy), "a")


def commit(rank: int, domain: str, epoch: int) -> Commit:
    return Commit("job", rank, domain, epoch)


# -- the recoverable set under each policy ---------------------------------------


def test_nothing_committed_means_nothing_recoverable() -> None:
    assert facts(Policy.all_of("nvme")).recoverable == IntervalSet()


def test_all_of_needs_every_domain_for_every_rank() -> None:
    f = facts(Policy.all_of("nvme", "s3"))
    for fact in [
        commit(0, "nvme", 1),
        commit(0, "s3", 1),
        commit(1, "nvme", 1),
        commit(1, "s3", 1),
        commit(0, "nvme", 2),
        commit(0, "s3", 2),
        commit(1, "nvme", 2),  # rank 1 lacks s3 for epoch 2
    ]:
        f.apply(fact)
    assert f.recoverable == IntervalSet.of(1)


def test_any_of_needs_one_domain_for_every_rank() -> None:
    f = facts(Policy.any_of("nvme", "s3"))
    for fact in [
        commit(0, "nvme", 1),
        commit(1, "s3", 1),
        commit(0, "s3", 2),  # rank 1 holds epoch 2 nowhere
        commit(0, "nvme", 3),
        commit(1, "nvme", 3),
    ]:
        f.apply(fact)
    assert f.recoverable == IntervalSet.of(1, 3)


def test_a_domain_outside_the_policy_does_not_count() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "ram", 5))
    f.apply(commit(1, "ram", 5))
    assert f.recoverable == IntervalSet()


def test_one_rank_alone_is_not_enough() -> None:
    f = facts(Policy.any_of("nvme"))
    f.apply(commit(0, "nvme", 5))
    assert f.recoverable == IntervalSet()
    f.apply(commit(1, "nvme", 5))
    assert f.recoverable == IntervalSet.of(5)


def test_retract_removes_an_epoch() -> None:
    f = facts(Policy.all_of("nvme"))
    for e in (1, 2, 3):
        f.apply(commit(0, "nvme", e))
        f.apply(commit(1, "nvme", e))
    assert f.apply(Retract("job", 1, "nvme", 2)) is True
    assert f.recoverable == IntervalSet.of(1, 3)


def test_a_retracted_epoch_may_be_committed_again() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "nvme", 2))
    f.apply(commit(1, "nvme", 2))
    f.apply(Retract("job", 1, "nvme", 2))
    f.apply(commit(1, "nvme", 2))
    assert f.recoverable == IntervalSet.of(2)


def test_retire_removes_an_epoch() -> None:
    f = facts(Policy.all_of("nvme"))
    for e in (1, 2):
        f.apply(commit(0, "nvme", e))
        f.apply(commit(1, "nvme", e))
    assert f.apply(Retire("job", 0, "nvme", 1)) is True
    assert f.recoverable == IntervalSet.of(2)


def test_under_any_of_losing_one_domain_keeps_the_epoch_if_another_holds_it() -> None:
    f = facts(Policy.any_of("nvme", "s3"))
    for rank in RANKS_A:
        f.apply(commit(rank, "nvme", 4))
        f.apply(commit(rank, "s3", 4))
    f.apply(Retract("job", 0, "nvme", 4))
    assert f.recoverable == IntervalSet.of(4)
    f.apply(Retire("job", 0, "s3", 4))
    assert f.recoverable == IntervalSet()


def test_apply_reports_whether_anything_changed() -> None:
    f = facts(Policy.all_of("nvme"))
    assert f.apply(commit(0, "nvme", 1)) is True
    assert f.apply(commit(0, "nvme", 1)) is False
    assert f.apply(Retract("job", 0, "nvme", 9)) is False
    assert f.apply(commit(0, "ram", 1)) is True  # newest per domain changed


# -- model check ------------------------------------------------------------------

DOMAINS = ("nvme", "s3", "ram")


@dataclass
class Model:
    """Availability per (rank, domain) as plain Python sets."""

    policy: Policy
    held: dict[tuple[int, str], set[int]]
    retired: dict[tuple[int, str], set[int]]

    def recoverable(self) -> set[int]:
        per_rank = []
        for r in RANKS_A:
            sets = [self.held.get((r, d), set()) for d in self.policy.domains]
            if self.policy.mode is PolicyMode.ALL:
                per_rank.append(set.intersection(*sets))
            else:
                per_rank.append(set().union(*sets))
        return set.intersection(*per_rank)


epoch_facts = st.builds(
    lambda kind, rank, domain, epoch: kind("job", rank, domain, epoch),
    st.sampled_from([Commit, Commit, Commit, Retract, Retire]),
    st.sampled_from(RANKS_A),
    st.sampled_from(DOMAINS),
    st.integers(0, 12),
)


@PROPERTY
@given(
    st.sampled_from([PolicyMode.ALL, PolicyMode.ANY]),
    st.lists(st.sampled_from(DOMAINS[:2]), min_size=1, max_size=2, unique=True),
    st.lists(epoch_facts, max_size=40),
)
def test_recoverable_set_matches_a_model_of_commits_retracts_and_retires(
    mode: PolicyMode, domains: list[str], stream: list[EpochFact]
) -> None:
    policy = Policy(mode, tuple(sorted(domains)))
    f = facts(policy)
    model = Model(policy, {}, {})
    for fact in stream:
        key = (fact.rank, fact.domain)
        if isinstance(fact, Commit) and fact.epoch in model.retired.get(key, set()):
            with pytest.raises(FactError) as info:
                f.apply(fact)
            assert info.value.reason == "retired"
        else:
            f.apply(fact)
            held = model.held.setdefault(key, set())
            if isinstance(fact, Commit):
                held.add(fact.epoch)
            else:
                held.discard(fact.epoch)
                if isinstance(fact, Retire):
                    model.retired.setdefault(key, set()).add(fact.epoch)
        assert set(f.recoverable) == model.recoverable()
        # Checked after every fact: commits take an incremental path, the rest not.
        newest = {}
        for d in policy.domains:
            common = set.intersection(*(model.held.get((r, d), set()) for r in RANKS_A))
            if common:
                newest[d] = max(common)
        assert f.newest_by_domain() == newest


MANY_RANKS = tuple(range(6))


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([Policy.all_of("nvme", "s3"), Policy.any_of("nvme", "s3")]),
    st.lists(
        st.tuples(
            st.sampled_from(["commit"] * 6 + ["retract", "retire"]),
            st.sampled_from(MANY_RANKS),
            st.sampled_from(("nvme", "s3", "ram")),
            st.integers(0, 5),
        ),
        max_size=120,
    ),
)
def test_incremental_commits_agree_with_full_recomputation(
    policy: Policy, ops: list[tuple[str, int, str, int]]
) -> None:
    """Commits update the derived sets incrementally (resuming scans across ranks);
    a fresh recomputation from the same facts must always agree."""
    spec = StreamSpec.create("job", {"a": list(MANY_RANKS)}, policy)
    f = StreamFacts(spec, "a")
    kinds = {"commit": Commit, "retract": Retract, "retire": Retire}
    for kind, rank, domain, epoch in ops:
        try:
            f.apply(kinds[kind]("job", rank, domain, epoch))
        except FactError:
            continue
        fresh = StreamFacts(spec, "a", dict(f.available), dict(f.retired))
        assert f.recoverable == fresh.recoverable
        assert f.newest_by_domain() == fresh.newest_by_domain()


def test_a_retraction_between_commits_of_one_epoch_is_not_missed() -> None:
    spec = StreamSpec.create("job", {"a": [0, 1, 2]}, Policy.all_of("nvme"))
    f = StreamFacts(spec, "a")
    f.apply(commit(0, "nvme", 7))
    f.apply(commit(1, "nvme", 7))  # a scan now knows ranks 0 and 1 hold 7
    f.apply(Retract("job", 0, "nvme", 7))
    f.apply(commit(2, "nvme", 7))  # rank 0 no longer holds it: 7 is not complete
    assert 7 not in f.recoverable
    assert f.newest_by_domain() == {}


# -- refusals -----------------------------------------------------------------------


def test_commit_of_a_retired_epoch_is_refused_as_retired() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "nvme", 3))
    f.apply(Retire("job", 0, "nvme", 3))
    with pytest.raises(FactError) as info:
        f.apply(commit(0, "nvme", 3))
    assert info.value.reason == "retired"
    assert "epoch 3 was retired" in str(info.value)
    assert f.available[(0, "nvme")] == IntervalSet()


def test_retirement_is_per_rank_and_domain() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "nvme", 3))
    f.apply(Retire("job", 0, "nvme", 3))
    f.apply(commit(1, "nvme", 3))
    f.apply(commit(0, "s3", 3))
    assert 3 in f.available[(1, "nvme")]
    assert 3 in f.available[(0, "s3")]


def test_retract_does_not_forbid_a_later_commit_but_retire_does() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "nvme", 3))
    f.apply(Retract("job", 0, "nvme", 3))
    f.check(commit(0, "nvme", 3))
    f.apply(Retire("job", 0, "nvme", 3))
    with pytest.raises(FactError):
        f.check(commit(0, "nvme", 3))


@pytest.mark.parametrize(
    ("fact", "reason"),
    [
        (commit(2, "nvme", 1), "unknown_rank"),  # rank 2 lives on node b
        (commit(99, "nvme", 1), "unknown_rank"),
        (Retract("job", 7, "nvme", 1), "unknown_rank"),
        (Retire("job", 7, "nvme", 1), "unknown_rank"),
        (commit(0, "bad domain", 1), "bad_domain"),
        (commit(0, "", 1), "bad_domain"),
        (commit(0, "nvme", -1), "bad_epoch"),
        (commit(0, "nvme", MAX_EPOCH + 1), "bad_epoch"),
        (commit(0, "nvme", True), "bad_epoch"),
        (commit(0, "nvme", 1.0), "bad_epoch"),  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_invalid_facts_are_refused_with_a_reason(fact: EpochFact, reason: str) -> None:
    f = facts(Policy.all_of("nvme"))
    with pytest.raises(FactError) as info:
        f.check(fact)
    assert info.value.reason == reason
    with pytest.raises(FactError):
        f.apply(fact)
    assert f.available == {}
    assert f.retired == {}


# -- newest per domain --------------------------------------------------------------


def test_newest_by_domain_is_the_newest_epoch_every_local_rank_holds() -> None:
    f = facts(Policy.all_of("nvme", "ram"))
    for fact in [
        commit(0, "nvme", 5),
        commit(0, "nvme", 7),
        commit(1, "nvme", 5),
        commit(0, "ram", 9),
        commit(1, "ram", 9),
        commit(0, "s3", 2),  # rank 1 holds nothing in s3
    ]:
        f.apply(fact)
    assert f.newest_by_domain() == {"nvme": 5, "ram": 9}


def test_newest_by_domain_names_only_the_policy_domains() -> None:
    # An older log may hold commits to other domains: the record must not carry them
    # (a peer refuses a record of more than MAX_DOMAINS entries).
    f = facts(Policy.all_of("nvme"))
    for d in ("nvme", "ram", *(f"d{i}" for i in range(70))):
        f.apply(commit(0, d, 1))
        f.apply(commit(1, d, 1))
    assert f.newest_by_domain() == {"nvme": 1}


def test_newest_by_domain_drops_a_domain_after_its_epochs_are_retracted() -> None:
    f = facts(Policy.all_of("nvme"))
    f.apply(commit(0, "ram", 4))
    f.apply(commit(1, "ram", 4))
    f.apply(Retract("job", 1, "ram", 4))
    assert f.newest_by_domain() == {}


# -- the node: facts reach the published record, refusals change nothing ------------------


NVME = Policy.all_of("nvme")


def declared_node(policy: Policy = NVME, retention: int = 0) -> NodeCore:
    node = NodeCore("a", 1)
    node.apply(Declare(make_spec(policy, retention)))
    return node


def test_node_publishes_its_recoverable_set_and_newest_epochs() -> None:
    node = declared_node()
    for e in (1, 2):
        node.apply(commit(0, "nvme", e))
        node.apply(commit(1, "nvme", e))
    node.apply(Retract("job", 0, "nvme", 1))
    record = node.own_record("job")
    assert record is not None
    assert record.recoverable == IntervalSet.of(2)
    assert record.newest == (("nvme", 2),)
    assert node.status("job").recoverable == IntervalSet.of(2)


def test_node_refuses_facts_of_an_undeclared_stream() -> None:
    node = declared_node()
    with pytest.raises(UnknownStreamError) as info:
        node.check(Commit("other", 0, "nvme", 1))
    assert info.value.reason == "unknown_stream"
    with pytest.raises(UnknownStreamError):
        node.apply(HighWater("other", 3))


def _snapshot(node: NodeCore) -> tuple[Any, ...]:
    status = node.status("job")
    return (
        node.view.digest,
        node.view.seq,
        node.own_record("job"),
        status,
        list(pending_facts(node)),
        list(events(node)),
        copy.deepcopy(node._streams["job"].facts.available),
        copy.deepcopy(node._streams["job"].facts.retired),
        dict(node._streams["job"].facts.generations.frozen),
        node._streams["job"].facts.generations.closed_below,
    )


def _node_with_history() -> NodeCore:
    """Node a of a one-member stream with commits, a retirement and a resolved generation."""
    spec = StreamSpec.create("job", {"a": list(RANKS_A)}, Policy.all_of("nvme"))
    node = NodeCore("a", 1)
    node.apply(Declare(spec))
    for e in range(1, 6):
        node.apply(commit(0, "nvme", e))
        node.apply(commit(1, "nvme", e))
    node.apply(Retire("job", 0, "nvme", 1))
    for g in (1, 2):
        freeze = node.freeze_fact("job", g)
        assert freeze is not None
        node.apply(freeze)
    assert node.generation("job", 2).resolved
    return node


REFUSED: list[Fact] = [
    Commit("other", 0, "nvme", 2),
    Commit("job", 5, "nvme", 2),
    Commit("job", 0, "no such domain", 2),
    Commit("job", 0, "nvme", -4),
    Commit("job", 0, "nvme", 1),  # retired
    Retract("job", 9, "nvme", 3),
    Retire("job", 0, "nvme", MAX_EPOCH + 1),
    Freeze("job", 1, IntervalSet.of(3)),  # generation 1 is closed by generation 2
    Declare(StreamSpec.create("job", {"a": [0, 1]}, Policy.any_of("nvme"))),
    Declare(StreamSpec.create("job2", {"b": [0]}, Policy.any_of("nvme"))),
]


@pytest.mark.parametrize("fact", REFUSED, ids=repr)
def test_node_check_and_apply_of_a_refused_fact_change_nothing(fact: Fact) -> None:
    node = _node_with_history()
    clear_events(node)
    clear_facts(node)
    before = _snapshot(node)
    with pytest.raises(Exception) as checked:
        node.check(fact)
    assert _snapshot(node) == before
    with pytest.raises(type(checked.value)):
        node.apply(fact)
    assert _snapshot(node) == before


def test_freeze_of_a_closed_generation_is_refused_as_closed() -> None:
    node = _node_with_history()
    with pytest.raises(GenerationClosedError) as info:
        node.check(Freeze("job", 1, IntervalSet.of(3)))
    assert info.value.reason == "generation_closed"


def test_node_check_accepts_what_apply_then_applies() -> None:
    node = declared_node()
    fact = commit(0, "nvme", 3)
    before = node.view.digest
    node.check(fact)
    assert node.view.digest == before
    node.apply(fact)
    assert node._streams["job"].facts.available[(0, "nvme")] == IntervalSet.of(3)
