"""NodeCore.apply_many: facts applied together, each stream refreshed once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from convergenced.core.errors import FactError
from convergenced.core.facts import Commit, Declare, Fact, HighWater, Horizon, Retract, Settled
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0, 1, 2, 3]}, Policy.all_of("nvme"))
OTHER = StreamSpec.create("other", {"a": [0]}, Policy.all_of("nvme"))


def declared(*specs: StreamSpec) -> NodeCore:
    node = NodeCore("a", 1)
    for spec in specs:
        node.apply(Declare(spec))
    node.take_pending_facts()
    return node


def test_the_facts_come_out_as_pending_in_order_ahead_of_the_refresh() -> None:
    node = declared(SPEC)
    commits = [Commit("job", r, "nvme", 1) for r in range(4)]
    node.apply_many(commits)
    pending = node.take_pending_facts()
    assert pending[:4] == commits
    assert [type(f) for f in pending[4:]] == [HighWater, Horizon]  # from the one refresh
    assert node.restore_point("job") == 1


def test_each_stream_is_refreshed_once_one_record_version_each() -> None:
    node = declared(SPEC, OTHER)
    before = {s: node.own_record(s) for s in ("job", "other")}
    node.apply_many([Commit("job", r, "nvme", e) for e in (1, 2) for r in range(4)]
                    + [Commit("other", 0, "nvme", 7)])  # fmt: skip
    for name in ("job", "other"):
        old, new = before[name], node.own_record(name)
        assert old is not None and new is not None
        assert new.version > old.version
    versions = sorted(r.version for r in (node.own_record("job"), node.own_record("other")) if r)
    assert versions[1] - versions[0] == 1  # one new version per stream, no more
    assert node.restore_point("job") == 2 and node.restore_point("other") == 7


def test_a_refused_fact_stops_the_run_and_the_ones_before_it_stand() -> None:
    node = declared(SPEC)
    good = [Commit("job", 0, "nvme", 1), Commit("job", 1, "nvme", 1)]
    with pytest.raises(FactError):
        node.apply_many([*good, Commit("job", 9, "nvme", 1), Commit("job", 2, "nvme", 1)])
    assert node.take_pending_facts() == good
    assert node.status("job").newest == {"a": {}}  # rank 2 and 3 hold nothing
    assert node.own_record("job") is not None


def test_checked_skips_the_check_of_commits_only() -> None:
    node = declared(SPEC)
    # Admission checks each commit before handing the run in; anything else in a run
    # is still checked, and refused without a change.
    with pytest.raises(FactError):
        node.apply_many([Commit("job", 0, "nvme", 1), Retract("job", 9, "nvme", 1)],
                        checked=True)  # fmt: skip
    assert node.take_pending_facts() == [Commit("job", 0, "nvme", 1)]
    node.apply_many([Commit("job", r, "nvme", 1) for r in (1, 2, 3)], checked=True)
    assert node.restore_point("job") == 1


def test_a_declaration_comes_out_before_the_settled_fact_it_leads_to() -> None:
    node = NodeCore("a", 1, unsure_of_past=True)
    solo = StreamSpec.create("solo", {"a": [0]}, Policy.all_of("nvme"))
    node.apply_many([Declare(solo), Commit("solo", 0, "nvme", 3)])
    assert node.take_pending_facts()[:3] == [
        Declare(solo),
        Settled("solo"),
        Commit("solo", 0, "nvme", 3),
    ]


def test_with_the_gate_the_facts_get_positions_and_hold_the_bytes() -> None:
    node = NodeCore("a", 1)
    gate = OutputGate(node)
    gate.apply(Declare(SPEC))
    gate.synced(gate.take_unlogged()[1])
    out = gate.output()
    node.apply_many([Commit("job", r, "nvme", 5) for r in range(4)])
    out.send(b"acknowledges the four commits")
    assert out.release() == []
    facts, upto = gate.take_unlogged()
    assert [type(f) for f in facts] == [Commit] * 4 + [HighWater, Horizon]
    gate.synced(upto)
    assert out.release() == [b"acknowledges the four commits"]


_ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 6)), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(_ops, st.lists(st.integers(1, 8), min_size=1, max_size=20))
def test_the_same_state_as_applying_one_by_one(
    ops: list[tuple[bool, int, int]], cuts: list[int]
) -> None:
    facts: list[Fact] = [
        Commit("job", r, "nvme", e) if commit else Retract("job", r, "nvme", e)
        for commit, r, e in ops
    ]
    one, many = declared(SPEC), declared(SPEC)
    for fact in facts:
        one.apply(fact)
    at, i = 0, 0
    while at < len(facts):
        n = cuts[i % len(cuts)]
        many.apply_many(facts[at : at + n])
        at, i = at + n, i + 1
    a, b = one.status("job"), many.status("job")
    assert (a.recoverable, a.restore_point, a.high_water, a.newest, a.safe_to_delete) == (
        b.recoverable,
        b.restore_point,
        b.high_water,
        b.newest,
        b.safe_to_delete,
    )
    ra, rb = one.own_record("job"), many.own_record("job")
    assert ra is not None and rb is not None
    assert (ra.recoverable, ra.newest, ra.proposal, ra.restore_point, ra.high_water) == (
        rb.recoverable,
        rb.newest,
        rb.proposal,
        rb.restore_point,
        rb.high_water,
    )
    # What the gate logs replays to the same node.
    logged = many.take_pending_facts()
    replayed = NodeCore("a", 2)
    replayed.replay([Declare(SPEC), *logged])
    assert replayed.status("job").recoverable == b.recoverable
