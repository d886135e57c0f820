"""Changing membership: a replaced node, a job that shrinks or grows. Core only, no I/O.

A relaunch declares a new membership of its stream: the same name, policy, retention
and scopes, another member map, and ``membership`` = the generation the launch asked
for. Members that are no longer in the map stop blocking, a spare takes over ranks by
committing their shared-tier copies (adoption), and every member of the new map
returns the same restore point for the launch's generation.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from convergenced.core.errors import FactError, SpecConflictError, SpecError
from convergenced.core.events import MembershipChanged, RestorePointChanged
from convergenced.core.facts import Commit, Declare, Freeze, HighWater, Retire
from convergenced.core.generations import GenerationClosedError, MembershipSupersededError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import decode_entry, encode_entry

STREAM = "job"
POLICY = Policy.any_of("nvme", "s3")


def spec(members: Mapping[str, list[int]], membership: int = 0) -> StreamSpec:
    return StreamSpec.create(STREAM, members, POLICY, 0, shared=["s3"], membership=membership)


FIRST = {"a": [0], "b": [1], "c": [2]}


def sync(*nodes: NodeCore) -> None:
    for _ in range(30):
        changed = False
        for src in nodes:
            for dst in nodes:
                if src is not dst and dst.receive(list(src.view), via=src.node_id):
                    changed = True
        if not changed:
            return
    raise AssertionError("records did not stop changing")


def start(members: Mapping[str, list[int]]) -> dict[str, NodeCore]:
    nodes = {m: NodeCore(m, 1) for m in members}
    for n in nodes.values():
        n.apply(Declare(spec(members)))
    return nodes


def save(node: NodeCore, epoch: int, *domains: str) -> None:
    for rank in node.spec(STREAM).ranks_of(node.node_id):
        for d in domains:
            node.apply(Commit(STREAM, rank, d, epoch))
    for fact in node.take_pending_facts():
        node.apply(fact)


def freeze(node: NodeCore, generation: int) -> None:
    fact = node.freeze_fact(STREAM, generation)
    assert fact is not None
    node.apply(fact)


def events(node: NodeCore) -> list[object]:
    out = []
    while (ev := node.next_event()) is not None:
        out.append(ev)
    return out


def trained(nodes: dict[str, NodeCore]) -> None:
    """Epochs 1-3 in nvme everywhere, 1-2 also in s3 (uploads lag one epoch)."""
    for e in (1, 2, 3):
        for n in nodes.values():
            save(n, e, "nvme", *(["s3"] if e < 3 else []))
        sync(*nodes.values())
    assert {n.restore_point(STREAM) for n in nodes.values()} == {3}


def test_a_spare_takes_over_the_dead_nodes_rank_from_the_shared_tier() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a, b = nodes["a"], nodes["b"]  # c dies for good: its nvme copies go with it
    d = NodeCore("d", 1)
    sync(a, b, d)
    g = d.next_generation(STREAM)  # the spare asks: it has not declared the stream yet
    assert g == a.next_generation(STREAM) == 1  # above membership 0, declared
    new = spec({"a": [0], "b": [1], "d": [2]}, membership=g)
    for n in (a, b, d):
        events(n)
        n.apply(Declare(new))
    # The spare's integration verifies rank 2's shards in the shared tier and commits
    # them on its behalf (adoption); its node-local copies were on c.
    for e in (1, 2):
        d.apply(Commit(STREAM, 2, "s3", e))
    for n in (a, b, d):
        freeze(n, g)
    sync(a, b, d)
    answers = {n.node_id: n.generation(STREAM, g) for n in (a, b, d)}
    assert {x.restore_point for x in answers.values()} == {2}, answers
    assert all(x.resolved for x in answers.values())
    # The members of the old map are gone from the new one's agreement: c blocks nothing.
    assert a.spec(STREAM).member_ids == ("a", "b", "d")
    assert a.status(STREAM).knowledge.name != "INCOMPLETE"


def test_the_change_is_reported_and_the_restore_point_starts_over() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a = nodes["a"]
    events(a)
    a.apply(Declare(spec({"a": [0], "b": [1], "d": [2]}, membership=1)))
    got = events(a)
    assert MembershipChanged(STREAM, 1, ("c",), ("d",), (2,), (("c", "d"),)) in got
    assert RestorePointChanged(STREAM, 3, None, True) in got
    assert a.restore_point(STREAM) is None  # d's record is missing: nothing is known
    assert a.own_record(STREAM) is not None and a.own_record(STREAM).membership == 1  # type: ignore[union-attr]


def test_a_membership_that_is_not_newer_or_a_different_map_is_refused() -> None:
    nodes = start(FIRST)
    a, b = nodes["a"], nodes["b"]
    freeze(a, 4)
    with pytest.raises(MembershipSupersededError) as info:  # 4 was frozen under the old map
        a.check(Declare(spec({"a": [0], "b": [1, 2]}, membership=4)))
    assert info.value.reason == "membership_superseded"
    a.apply(Declare(spec({"a": [0], "b": [1, 2]}, membership=5)))
    with pytest.raises(SpecConflictError):  # one membership, two maps
        a.check(Declare(spec({"a": [0, 2], "b": [1]}, membership=5)))
    with pytest.raises(MembershipSupersededError):  # an older launch's map
        a.check(Declare(spec({"a": [0], "b": [1], "c": [2]}, membership=3)))
    with pytest.raises(SpecConflictError):  # another policy is another stream
        a.check(Declare(StreamSpec.create(STREAM, {"a": [0]}, Policy.all_of("s3"), 0,
                                          membership=6)))  # fmt: skip
    # The other members learn of the map from the records: b, declaring a different
    # map for the same membership, is refused too.
    sync(a, b)
    with pytest.raises(SpecConflictError):
        b.check(Declare(spec({"a": [0, 2], "b": [1]}, membership=5)))
    b.apply(Declare(spec({"a": [0], "b": [1, 2]}, membership=5)))


def test_a_member_on_another_membership_is_missing_not_in_conflict() -> None:
    nodes = start(FIRST)
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    a.apply(Declare(spec({"a": [0], "b": [1, 2]}, membership=1)))
    sync(a, b, c)
    events(b)
    assert a.status(STREAM).conflicts == () and b.status(STREAM).conflicts == ()
    assert not [e for e in events(b) if type(e).__name__ == "SpecConflictDetected"]


def test_generations_of_the_old_map_stay_protected_until_a_newer_one_resolves() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a, b = nodes["a"], nodes["b"]
    freeze(a, 0)  # a launch froze generation 0 on a; c died before it froze
    freeze(b, 0)
    sync(a, b)
    assert a.status(STREAM).generations == (0,)
    new = spec({"a": [0, 2], "b": [1]}, membership=1)  # shrink: a takes rank 2 over
    for n in (a, b):
        n.apply(Declare(new))
    assert a.freeze_fact(STREAM, 0) is None  # frozen already, and belongs to the old map:
    with pytest.raises(GenerationClosedError) as info:  # it is never answered again
        a.generation(STREAM, 0)
    assert "new member map" in str(info.value)
    assert a.status(STREAM).generations == (0,)  # still open: protects
    a.apply(Commit(STREAM, 2, "s3", 1))
    a.apply(Commit(STREAM, 2, "s3", 2))
    for n in (a, b):
        freeze(n, 1)
    sync(a, b)
    assert a.generation(STREAM, 1).restore_point == b.generation(STREAM, 1).restore_point == 2
    assert a.status(STREAM).generations == (1,)  # 0 closed by 1


def test_ranks_that_moved_away_are_forgotten_and_new_ones_start_empty() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a = nodes["a"]
    a.apply(Declare(spec({"a": [2], "b": [0, 1]}, membership=1)))
    with pytest.raises(FactError) as info:
        a.check(Commit(STREAM, 0, "nvme", 4))
    assert info.value.reason == "unknown_rank"
    assert a.status(STREAM).recoverable == IntervalSet()  # rank 2 holds nothing here yet
    a.apply(Commit(STREAM, 2, "s3", 2))
    assert a.status(STREAM).recoverable == IntervalSet.span(2, 2)


def test_a_restart_does_not_bring_back_the_old_maps_restore_point() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a = nodes["a"]
    for fact in a.take_pending_facts():
        a.apply(fact)
    a.apply(Declare(spec({"a": [0], "b": [1], "d": [2]}, membership=1)))
    facts = a.compacted_facts()
    again = NodeCore("a", 2)
    again.replay(facts)
    assert again.restore_point(STREAM) is None  # 3 was the old world's, d cannot read it
    assert again.own_record(STREAM).high_water == 3  # type: ignore[union-attr]
    # The log entries keep the membership of each mark.
    for fact in facts:
        if isinstance(fact, HighWater):
            assert decode_entry(encode_entry(fact)) == fact


def test_the_mark_of_the_current_membership_stands_in_after_a_restart() -> None:
    nodes = start(FIRST)
    trained(nodes)
    new = spec({"a": [0], "b": [1, 2]}, membership=1)
    a, b = nodes["a"], nodes["b"]
    for n in (a, b):
        n.apply(Declare(new))
    b.apply(Commit(STREAM, 2, "nvme", 3))
    sync(a, b)
    assert a.restore_point(STREAM) == b.restore_point(STREAM) == 3
    again = NodeCore("a", 2)
    again.replay(a.compacted_facts())
    assert again.restore_point(STREAM) == 3


def test_spec_scopes_and_membership_are_validated_and_keep_old_digests() -> None:
    plain = StreamSpec.create(STREAM, {"a": [0]}, POLICY, 0)
    assert StreamSpec.from_wire(plain.to_wire()) == plain
    assert "shared" not in plain.to_wire() and "membership" not in plain.to_wire()
    moved = StreamSpec.create(STREAM, {"a": [0]}, POLICY, 0, shared=["s3"], membership=3)
    assert StreamSpec.from_wire(moved.to_wire()) == moved and moved.digest != plain.digest
    assert moved.is_shared("s3") and not moved.is_shared("nvme")
    assert moved.same_stream(StreamSpec.create(STREAM, {"b": [0]}, POLICY, 0, shared=["s3"]))
    for bad in ({"shared": ["gcs"]}, {"shared": "s3"}, {"membership": -1}, {"membership": "1"}):
        with pytest.raises(SpecError):
            StreamSpec.from_wire({**plain.to_wire(), **bad})


def test_old_generations_frozen_before_the_change_replay_in_any_order() -> None:
    """Compaction writes the new declaration first and the old map's frozen sets after
    it: replaying them must not refuse those (they are facts, not requests)."""
    nodes = start(FIRST)
    trained(nodes)
    a = nodes["a"]
    freeze(a, 0)
    a.apply(Declare(spec({"a": [0], "b": [1, 2]}, membership=1)))
    facts = a.compacted_facts()
    assert any(isinstance(f, Freeze) and f.generation == 0 for f in facts)
    again = NodeCore("a", 2)
    again.replay(facts)
    assert again.status(STREAM).generations == (0,)


def test_a_spare_deletes_nothing_until_every_member_of_the_new_map_published() -> None:
    nodes = start(FIRST)
    trained(nodes)
    a, b = nodes["a"], nodes["b"]
    d = NodeCore("d", 1)
    new = spec({"a": [0], "b": [1], "d": [2]}, membership=1)
    for n in (a, b, d):
        n.apply(Declare(new))
    sync(a, b)  # d is not heard yet
    assert a.safe_to_delete(STREAM) == IntervalSet()
    for e in a.safe_to_delete(STREAM):
        a.apply(Retire(STREAM, 0, "nvme", e))


def test_gc_keeps_the_newest_shared_epoch_of_the_member_that_lags_most() -> None:
    """The portable cap: if c's host died now, its rank could only restore from the
    shared tier, where it has epoch 3 at most; so 3 stays on every member."""
    nodes = start(FIRST)
    for e in range(1, 6):
        for n in nodes.values():
            save(n, e, "nvme", *(["s3"] if n.node_id != "c" or e <= 3 else []))
        sync(*nodes.values())
    a = nodes["a"]
    assert a.restore_point(STREAM) == 5
    assert a.safe_to_delete(STREAM) == IntervalSet.span(1, 2)  # not 3 and 4
    assert a.status(STREAM).gc_horizon == 3
    # Without a shared domain nothing survives a move: the horizon is the plain one.
    plain = {m: NodeCore(m, 1) for m in FIRST}
    for n in plain.values():
        n.apply(Declare(StreamSpec.create(STREAM, FIRST, POLICY, 0)))
    for e in range(1, 6):
        for n in plain.values():
            save(n, e, "nvme", *(["s3"] if n.node_id != "c" or e <= 3 else []))
        sync(*plain.values())
    assert plain["a"].safe_to_delete(STREAM) == IntervalSet.span(1, 4)


def test_the_change_says_which_member_replaced_which() -> None:
    """``replaced`` pairs a member that left with one that joined hosting its ranks;
    a rank taken over by a member that stayed is moved, not a replacement."""
    four = {"a": [0], "b": [1], "c": [2], "e": [3]}
    a = start(four)["a"]
    events(a)
    a.apply(Declare(spec({"a": [0, 3], "d": [1, 2]}, membership=1)))
    changed = [e for e in events(a) if isinstance(e, MembershipChanged)]
    assert changed == [MembershipChanged(STREAM, 1, ("b", "c", "e"), ("d",), (1, 2, 3),
                                         (("b", "d"), ("c", "d")))]  # fmt: skip
    a.apply(Declare(spec({"a": [0, 1, 2, 3]}, membership=2)))  # shrink: nobody joins
    assert [e for e in events(a) if isinstance(e, MembershipChanged)] == [
        MembershipChanged(STREAM, 2, ("d",), (), (1, 2), ())
    ]


def test_a_node_unsure_of_its_past_settles_when_the_member_it_waited_for_leaves() -> None:
    """Found by the simulator (convergenced sim --seed 28 --faults
    crash,lose_state,replace,shrink,grow,leave): a node that lost its state waited for
    a member whose host then died for good; the new map without it never settled."""
    nodes = start(FIRST)
    trained(nodes)
    b = nodes["b"]
    a = NodeCore("a", 1, unsure_of_past=True)  # a lost its state directory
    a.apply(Declare(spec(FIRST)))
    summary = [(r.stream, r.origin, r.incarnation, r.version) for r in b.view]
    a.hello_from("b", b.incarnation, summary)
    a.receive(list(b.view), via="b")
    assert a.waiting_to_freeze(STREAM) == ("c",)  # c's host is gone
    a.apply(Declare(spec({"a": [0, 2], "b": [1]}, membership=1)))
    mine = a.own_record(STREAM)  # published under the new map, in this life
    assert mine is not None and mine.membership == 1 and mine.incarnation == a.incarnation
    assert a.freeze_fact(STREAM, 1) is not None


def test_a_node_left_out_refuses_another_map_its_members_declared_for_that_membership() -> None:
    """c still holds the first map; a and b declared one with d for membership 1. A
    second launch that kept c declares the first map again for membership 1: c must
    refuse it from a's record, like a and b (its check skips only its own notices)."""
    nodes = start(FIRST)
    trained(nodes)
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    d = NodeCore("d", 1)
    for n in (a, b, d):
        n.apply(Declare(spec({"a": [0], "b": [1], "d": [2]}, membership=1)))
    sync(a, b, c, d)
    for n in (a, b, c):
        with pytest.raises(SpecConflictError):
            n.check(Declare(spec(FIRST, membership=1)))
