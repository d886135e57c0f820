"""Agreement rules on NodeCore objects that swap records directly (no links, no bytes).

Every member hosts one rank and the policy is "all of [nvme]", so a node's
recoverable set is exactly the epochs it committed and did not retract or retire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import event as hypothesis_event
from hypothesis import given, settings
from hypothesis import strategies as st
from pulled import clear_events, events, pending_facts

from convergenced.core.admission import Admission
from convergenced.core.aggregate import MemberAggregate, Summary
from convergenced.core.agreement import Knowledge
from convergenced.core.errors import FactError
from convergenced.core.events import StateLost
from convergenced.core.facts import (
    Commit,
    Declare,
    Fact,
    Freeze,
    HighWater,
    Incarnation,
    Retire,
    Retract,
)
from convergenced.core.gate import OutputGate
from convergenced.core.interval_set import IntervalSet
from convergenced.core.local_api_codec import ApiError
from convergenced.core.node import (
    GenerationClosedError,
    GenerationResolved,
    NodeCore,
    NodeEvent,
    RestorePointChanged,
    SpecConflictDetected,
)
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec

STREAM = "job"
RANK = {"a": 0, "b": 1, "c": 2}


def make_spec(members: str = "ab", retention: int = 0) -> StreamSpec:
    return StreamSpec.create(
        STREAM, {m: [RANK[m]] for m in members}, Policy.all_of("nvme"), retention
    )


def cluster(members: str = "ab", retention: int = 0) -> dict[str, NodeCore]:
    nodes = {}
    for m in members:
        node = NodeCore(m, 1)
        node.apply(Declare(make_spec(members, retention)))
        nodes[m] = node
    return nodes


def commit(node: NodeCore, *epochs: int) -> None:
    for e in epochs:
        node.apply(Commit(STREAM, RANK[node.node_id], "nvme", e))


def retract(node: NodeCore, *epochs: int) -> None:
    for e in epochs:
        node.apply(Retract(STREAM, RANK[node.node_id], "nvme", e))


def send(src: NodeCore, dst: NodeCore) -> None:
    """``dst`` receives everything ``src`` holds (one direction of one exchange)."""
    dst.receive(list(src.view))


def sync(*nodes: NodeCore) -> None:
    """Swap records between every pair until nothing changes any more."""
    for _ in range(20):
        changed = False
        for src in nodes:
            for dst in nodes:
                if src is not dst and dst.receive(list(src.view)):
                    changed = True
        if not changed:
            return
    raise AssertionError("records did not stop changing")


def rp(node: NodeCore) -> int | None:
    return node.restore_point(STREAM)


def restore_events(node: NodeCore) -> list[RestorePointChanged]:
    return [e for e in events(node) if isinstance(e, RestorePointChanged)]


def high_waters(node: NodeCore) -> list[int]:
    return [f.epoch for f in pending_facts(node) if isinstance(f, HighWater)]


# -- the member aggregate ------------------------------------------------------------


summaries = st.one_of(
    st.just(Summary.absent()),
    st.builds(
        Summary.of_member,
        st.lists(st.integers(0, 12), max_size=6).map(lambda es: IntervalSet.of(*es)),
        st.none() | st.integers(0, 12),
        st.none() | st.integers(0, 12),
        st.none() | st.integers(0, 12),
    ),
)


def _fold(leaves: list[Summary]) -> Summary:
    """The aggregate computed the obvious way, member by member."""
    present = [leaf for leaf in leaves if not leaf.missing]
    missing = len(leaves) - len(present)
    recoverable = None
    if not missing:
        recoverable = IntervalSet.intersect_all(
            [p.recoverable for p in present if p.recoverable is not None]
        )
    proposals = [leaf.min_proposal for leaf in leaves]
    points = [leaf.min_restore_point for leaf in leaves]
    waters = [leaf.max_high_water for leaf in leaves if leaf.max_high_water is not None]
    return Summary(
        missing,
        recoverable,
        None if None in proposals else min(p for p in proposals if p is not None),
        None if None in points else min(p for p in points if p is not None),
        max(waters, default=None),
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.data())
def test_member_aggregate_root_equals_a_fold_over_all_members(
    size: int, data: st.DataObject
) -> None:
    members = tuple(f"m{i}" for i in range(size))
    agg = MemberAggregate(members)
    leaves = dict.fromkeys(members, Summary.absent())
    assert agg.root == _fold(list(leaves.values()))
    for _ in range(data.draw(st.integers(1, 12))):
        batch = data.draw(st.lists(st.tuples(st.sampled_from(members), summaries), max_size=4))
        if len(batch) == 1 and data.draw(st.booleans()):
            agg.set(*batch[0])
        else:
            agg.set_many(batch)
        leaves.update(batch)
        assert agg.root == _fold(list(leaves.values()))
        assert all(agg.leaf(m) == leaf for m, leaf in leaves.items())


# -- proposal and convergence interval ------------------------------------------


def test_convergence_interval_is_the_intersection_of_member_sets() -> None:
    n = cluster()
    commit(n["a"], 1, 2, 3, 4, 5, 9)
    commit(n["b"], 3, 4, 5, 6, 7, 8, 9)
    sync(*n.values())
    for node in n.values():
        assert node.status(STREAM).convergence == IntervalSet.of(3, 4, 5, 9)


def test_proposal_is_the_newest_epoch_of_the_convergence_interval() -> None:
    n = cluster()
    commit(n["a"], 1, 2, 3, 4, 5)
    commit(n["b"], 3, 4, 5, 6, 7, 8)
    sync(*n.values())
    for node in n.values():
        assert node.status(STREAM).proposal == 5
        record = node.own_record(STREAM)
        assert record is not None
        assert record.proposal == 5


def test_without_every_members_record_nothing_is_known() -> None:
    n = cluster()
    commit(n["a"], 1, 2)
    status = n["a"].status(STREAM)
    assert status.convergence is None
    assert status.proposal is None
    assert status.restore_point is None
    assert status.knowledge is Knowledge.INCOMPLETE
    assert status.missing == ("b",)


def test_empty_convergence_interval_gives_no_proposal() -> None:
    n = cluster()
    commit(n["a"], 1, 2)
    commit(n["b"], 3, 4)
    sync(*n.values())
    status = n["a"].status(STREAM)
    assert status.convergence == IntervalSet()
    assert status.proposal is None
    assert status.restore_point is None
    assert status.knowledge is Knowledge.INTERVAL


def test_single_member_stream_restores_its_own_newest_epoch() -> None:
    node = cluster("a")["a"]
    commit(node, 4, 5)
    assert rp(node) == 5
    assert node.status(STREAM).knowledge is Knowledge.PUBLISHED


# -- restore point and knowledge levels ------------------------------------------------


def test_restore_point_waits_for_every_members_proposal() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4, 5)
    commit(b, 3, 4, 5, 6)
    send(b, a)  # b's record has no proposal yet: b never saw a
    status = a.status(STREAM)
    assert status.convergence == IntervalSet.span(3, 5)
    assert status.proposal == 5
    assert status.restore_point is None
    assert status.knowledge is Knowledge.INTERVAL


def test_knowledge_rises_from_interval_to_proposed_to_published() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4, 5)
    commit(b, 3, 4, 5, 6)
    assert a.status(STREAM).knowledge is Knowledge.INCOMPLETE
    send(b, a)
    assert a.status(STREAM).knowledge is Knowledge.INTERVAL
    send(a, b)  # a proposed 5: b can set its restore point, a has not published one
    assert b.status(STREAM).restore_point == 5
    assert b.status(STREAM).knowledge is Knowledge.PROPOSED
    send(b, a)  # b proposed and published 5
    assert a.status(STREAM).restore_point == 5
    assert a.status(STREAM).knowledge is Knowledge.PUBLISHED
    send(a, b)
    assert b.status(STREAM).knowledge is Knowledge.PUBLISHED


def test_restore_point_is_capped_by_the_lowest_proposal() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4)
    commit(b, 1, 2, 3, 4)
    sync(a, b)
    assert rp(a) == rp(b) == 4
    commit(a, 5, 6)
    commit(b, 5, 6)
    send(b, a)  # b still proposes 4: it has not seen a's 5 and 6
    assert a.status(STREAM).proposal == 6
    assert rp(a) == 4
    send(a, b)
    assert rp(b) == 6  # a proposed 6 and b's own proposal is 6
    send(b, a)
    assert rp(a) == 6


def test_restore_point_is_the_newest_agreed_epoch_in_the_interval() -> None:
    n = cluster("abc")
    commit(n["a"], 1, 2, 3, 7, 8)
    commit(n["b"], 2, 3, 4, 7, 8, 9)
    commit(n["c"], 0, 2, 3, 5, 7)
    sync(*n.values())
    for node in n.values():
        assert node.status(STREAM).convergence == IntervalSet.of(2, 3, 7)
        assert rp(node) == 7


# -- monotonicity, validity and liveness under random exchanges -------------------------

Op = tuple[str, str, int]
"""(operation, node or "*", number): see `Harness.run`."""


def ops(*kinds: str, max_size: int = 40) -> st.SearchStrategy[list[Op]]:
    """Random operation lists; repeating a kind in ``kinds`` makes it more frequent."""
    nodes = st.sampled_from("abc")
    makers = {
        "commit": st.tuples(st.just("commit"), nodes, st.integers(0, 9)),
        "commit_all": st.tuples(st.just("commit_all"), st.just("*"), st.integers(0, 9)),
        "commit_run": st.tuples(st.just("commit_run"), st.just("*"), st.integers(0, 9)),
        "retract": st.tuples(st.just("retract"), nodes, st.integers(0, 9)),
        "gc": st.tuples(st.just("gc"), nodes, st.just(0)),
        "freeze": st.tuples(st.just("freeze"), nodes, st.integers(1, 3)),
        "freeze_all": st.tuples(st.just("freeze_all"), st.just("*"), st.integers(1, 3)),
        "send": st.tuples(st.just("send"), nodes, st.integers(0, 2)),
        "sync": st.tuples(st.just("sync"), st.just("*"), st.just(0)),
    }
    return st.lists(st.one_of(*(makers[k] for k in kinds)), min_size=10, max_size=max_size)


@dataclass
class Harness:
    """Three nodes, their ground truth, and the checks run after every operation."""

    retention: int = 0
    nodes: dict[str, NodeCore] = field(default_factory=dict)
    committed: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in "abc"})
    retired: set[int] = field(default_factory=set)
    retracted: bool = False
    answers: dict[int, int | None] = field(default_factory=dict)
    """The first answer any member gave for each resolved generation."""
    high_water: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys("abc"))
    """Each node's high-water mark at the last check."""

    def __post_init__(self) -> None:
        self.nodes = cluster("abc", self.retention)

    def everywhere(self) -> set[int]:
        return set.intersection(*self.committed.values())

    def run(self, op: Op) -> None:
        kind, x, y = op
        if kind == "commit_all":
            for m in self.nodes:
                self.run(("commit", m, y))
            return
        if kind == "commit_run":  # every rank saves a few consecutive steps
            for e in range(max(y - 2, 0), y + 1):
                self.run(("commit_all", "*", e))
            return
        if kind == "freeze_all":
            for m in self.nodes:
                self.run(("freeze", m, y))
            return
        if kind == "sync":
            self.sync()
            return
        node = self.nodes[x]
        if kind == "commit":
            try:
                commit(node, y)
            except FactError as err:
                assert err.reason == "retired"  # refused, see test_facts
                return
            self.committed[x].add(y)
        elif kind == "retract":
            retract(node, y)
            self.retracted = True
        elif kind == "gc":
            # The rank deletes the oldest epoch it holds that the daemon says is safe.
            victim = (node.safe_to_delete(STREAM) & node.status(STREAM).recoverable).min()
            if victim is not None:
                # S4: no open generation of any member froze it. (A generation older
                # than one already resolved somewhere is superseded, no longer open.)
                newest_resolved = max(self.answers, default=0)
                for member in self.nodes.values():
                    record = member.own_record(STREAM)
                    assert record is not None
                    for g, frozen in record.generations:
                        assert g < newest_resolved or victim not in frozen, (g, frozen)
                node.apply(Retire(STREAM, RANK[x], "nvme", victim))
                self.retired.add(victim)
                hypothesis_event("an epoch was retired")
        elif kind == "freeze":
            try:
                fact = node.freeze_fact(STREAM, y)
            except GenerationClosedError:
                return
            if fact is not None:
                node.apply(fact)
        elif kind == "send":
            peer = sorted(set(self.nodes) - {x})[y % 2]
            self.send(node, self.nodes[peer])
        self.check()

    def send(self, src: NodeCore, dst: NodeCore) -> bool:
        changed = bool(dst.receive(list(src.view)))
        self.check()  # after every single evaluation, so each event meets its own floor
        return changed

    def sync(self) -> None:
        for _ in range(20):
            pairs = [(s, d) for s in self.nodes.values() for d in self.nodes.values() if s is not d]
            if not any([self.send(s, d) for s, d in pairs]):
                return
        raise AssertionError("records did not stop changing")

    def check(self) -> None:
        for m, node in self.nodes.items():
            status = node.status(STREAM)
            for event in events(node):
                if isinstance(event, RestorePointChanged):
                    self._check_restore_event(event, status.rollback_floor, self.high_water[m])
                elif isinstance(event, GenerationResolved):
                    self._check_generation(event)
            clear_events(node)
            self.high_water[m] = status.high_water
            if status.restore_point is not None:
                # S1: committed by every member, retired by none.
                assert all(status.restore_point in self.committed[k] for k in "abc"), m
                assert status.restore_point not in self.retired, m

    def _check_restore_event(
        self, event: RestorePointChanged, floor: int | None, high_water: int | None
    ) -> None:
        # Backwards from the last restore point, or, when the node has none (after a
        # loss), from its high-water mark: the last point it knew to be valid.
        reference = event.old if event.old is not None else high_water
        backwards = event.new is None or (reference is not None and event.new < reference)
        assert event.rollback == backwards  # S3: every backward move is reported
        assert not event.rollback or self.retracted  # ... and only a loss causes one
        if event.rollback:
            hypothesis_event(f"rollback to {'an epoch' if event.new is not None else 'none'}")
        if event.rollback and event.new is not None:
            assert floor is not None
            assert event.new >= floor

    def _check_generation(self, event: GenerationResolved) -> None:
        g, epoch = event.generation, event.restore_point
        if g not in self.answers:
            self.answers[g] = epoch
            hypothesis_event("generation resolved" + (" to an epoch" if epoch else ""))
            if epoch is not None:  # S1 at the moment of the first answer
                assert all(epoch in self.committed[k] for k in "abc")
                assert epoch not in self.retired
        assert self.answers[g] == epoch  # S2: every member gives the same answer


@settings(max_examples=100, deadline=None)
@given(ops("commit", "commit", "commit_all", "commit_run", "send", "send", "sync"))
def test_without_losses_restore_point_only_rises_and_ends_at_the_newest_common_epoch(
    script: list[Op],
) -> None:
    h = Harness()
    last: dict[str, int | None] = {m: None for m in "abc"}
    for op in script:
        h.run(op)
        for m, node in h.nodes.items():
            now, before = rp(node), last[m]
            if before is not None:
                assert now is not None
                assert now >= before  # S3: never backwards without a retraction
            last[m] = now
    h.sync()
    expected = max(h.everywhere(), default=None)
    assert [rp(node) for node in h.nodes.values()] == [expected] * 3  # S5
    for node in h.nodes.values():
        assert node.status(STREAM).knowledge is (
            Knowledge.PUBLISHED if expected is not None else Knowledge.INTERVAL
        )


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 3),
    ops("commit", "commit_all", "commit_run", "retract", "retract", "gc", "send", "send", "sync"),
)
def test_with_losses_and_deletions_restore_points_stay_valid_and_rollbacks_are_reported(
    retention: int, script: list[Op]
) -> None:
    h = Harness(retention)
    for op in script:
        h.run(op)


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2),
    ops("commit_all", "commit_run", "retract", "gc", "freeze", "freeze_all", "send", "sync"),
)
def test_every_member_resolves_a_generation_to_the_same_valid_epoch(
    retention: int, script: list[Op]
) -> None:
    h = Harness(retention)
    for op in script:
        h.run(op)
    h.sync()
    for g, epoch in h.answers.items():
        for node in h.nodes.values():
            try:
                answer = node.generation(STREAM, g)
            except GenerationClosedError:
                continue  # closed by a newer generation before this member answered
            assert answer.resolved
            assert answer.restore_point == epoch


# -- rollback --------------------------------------------------------------------------


def test_losing_the_restore_point_rolls_back_and_reports_it() -> None:
    n = cluster(retention=2)
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4, 5)
    commit(b, 1, 2, 3, 4, 5)
    sync(a, b)
    assert rp(a) == 5
    clear_events(a)
    retract(a, 5)
    assert rp(a) == 4
    assert restore_events(a) == [RestorePointChanged(STREAM, 5, 4, rollback=True)]
    sync(a, b)
    assert rp(b) == 4
    assert RestorePointChanged(STREAM, 5, 4, rollback=True) in restore_events(b)


def test_rollback_never_goes_below_the_floor() -> None:
    n = cluster(retention=1)
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4, 5)
    commit(b, 1, 2, 3, 4, 5)
    sync(a, b)
    clear_events(a)
    retract(a, 4, 5)  # 3 is still everywhere, but below the floor 5 - 1
    status = a.status(STREAM)
    assert status.convergence == IntervalSet.span(1, 3)
    assert status.rollback_floor == 4
    assert status.restore_point is None
    assert restore_events(a) == [RestorePointChanged(STREAM, 5, None, rollback=True)]
    commit(a, 4)  # 4 is back and at the floor: it may be the restore point again
    sync(a, b)
    assert rp(a) == rp(b) == 4


def test_rollback_floor_uses_the_highest_high_water_of_any_member() -> None:
    n = cluster(retention=2)
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 4, 5)
    commit(b, 1, 2, 3, 4, 5)
    b.apply(HighWater(STREAM, 7))  # b once published 7 (replayed from its log)
    sync(a, b)
    assert a.status(STREAM).rollback_floor == 5
    retract(a, 5)
    assert a.status(STREAM).restore_point is None  # 4 is below 7 - 2


def test_a_conflicting_member_record_keeps_the_restore_point_without_rollback() -> None:
    n = cluster()
    commit(n["a"], 1, 2)
    commit(n["b"], 1, 2)
    sync(*n.values())
    other = StreamSpec.create(STREAM, {"a": [0], "b": [1]}, Policy.any_of("nvme"))
    b2 = NodeCore("b", 2)
    b2.apply(Declare(other))  # b restarted with a different spec
    clear_events(n["a"])
    send(b2, n["a"])
    assert n["a"].status(STREAM).knowledge is Knowledge.INCOMPLETE
    assert rp(n["a"]) == 2
    assert restore_events(n["a"]) == []


def test_after_a_loss_a_point_below_the_high_water_mark_is_reported_as_rollback() -> None:
    n = cluster(retention=2)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    clear_events(a)
    retract(a, 3, 4, 5)  # 2 is below the floor 5 - 2: no restore point at all
    assert restore_events(a) == [RestorePointChanged(STREAM, 5, None, rollback=True)]
    clear_events(a)
    commit(a, 4)  # 4 is back: at the floor, but below the high-water mark 5
    assert restore_events(a) == [RestorePointChanged(STREAM, None, 4, rollback=True)]


def test_a_restarted_node_resumes_from_its_high_water_mark() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 3))
    stale_b = b.own_record(STREAM)  # b's record before it saved 3, 4 and 5
    assert stale_b is not None
    commit(b, *range(3, 6))
    sync(a, b)
    assert rp(a) == 5
    log: list[Fact] = [Declare(make_spec())]
    log += [Commit(STREAM, 0, "nvme", e) for e in range(1, 6)]
    log += pending_facts(a)  # the high-water marks a made durable
    restarted = NodeCore("a", 2)
    restarted.replay(log)
    assert rp(restarted) == 5
    # A relay brings back b's old record: it predates what justified the mark, so it
    # is no evidence that 5 was lost, and no rollback may be reported (S3).
    restarted.receive([stale_b])
    assert rp(restarted) == 5
    restarted.receive(list(b.view))
    assert rp(restarted) == 5
    assert restarted.status(STREAM).knowledge is Knowledge.PUBLISHED
    assert all(not e.rollback for e in restore_events(restarted))


# -- records about ourselves ---------------------------------------------------------------


def test_a_record_of_ours_we_did_not_make_lifts_us_above_it_and_changes_nothing_held() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2)
    impostor = NodeCore("a", 1)  # another life (or process) with a's identity
    impostor.apply(Declare(make_spec()))
    commit(impostor, 1, 2, 3, 4, 5, 6)
    assert b.receive(list(impostor.view))  # b cannot tell, and keeps the newer version
    kept = a.receive(list(b.view))
    assert [r.origin for r in kept] == ["b"]
    mine = a.own_record(STREAM)
    assert mine is not None and mine.incarnation == 2  # above the life it did not make
    assert Incarnation(2) in pending_facts(a)
    assert StateLost(1, 2) in events(a)
    assert a.status(STREAM).recoverable == IntervalSet.of(1, 2)  # its claims are not ours
    b.receive(list(a.view))
    assert b.view.get((STREAM, "a")) == mine  # peers take the honest record


def test_our_record_from_a_previous_life_is_kept_but_does_not_drive_our_state() -> None:
    old = NodeCore("a", 1)
    old.apply(Declare(make_spec()))
    commit(old, 1, 2, 3)
    new = NodeCore("a", 2)
    kept = new.receive(list(old.view))  # before the job declared the stream again
    assert [r.incarnation for r in kept] == [1]
    new.apply(Declare(make_spec()))
    assert new.status(STREAM).recoverable == IntervalSet()
    assert new.status(STREAM).proposal is None
    record = new.own_record(STREAM)
    assert record is not None
    assert record.incarnation == 2


# -- high-water facts ---------------------------------------------------------------------


def test_high_water_fact_is_pending_whenever_the_restore_point_rises() -> None:
    n = cluster(retention=1)
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    assert high_waters(a) == []
    sync(a, b)
    assert high_waters(a) == [3]
    assert high_waters(b) == [3]
    commit(a, 4, 5)
    commit(b, 4, 5)
    sync(a, b)
    assert high_waters(a) == [3, 5]
    retract(a, 5)  # roll back to 4: the high-water mark stays at 5
    sync(a, b)
    assert rp(a) == 4
    assert high_waters(a) == [3, 5]
    assert a.status(STREAM).high_water == 5
    record = a.own_record(STREAM)
    assert record is not None
    assert record.high_water == 5


# -- garbage collection --------------------------------------------------------------------


def test_gc_horizon_is_the_lowest_published_restore_point_minus_retention() -> None:
    n = cluster(retention=2)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 9))
    commit(b, *range(1, 9))
    sync(a, b)
    for node in (a, b):
        status = node.status(STREAM)
        assert status.gc_horizon == 6
        assert status.safe_to_delete == IntervalSet.span(1, 5)


def test_nothing_is_safe_to_delete_until_every_member_published_a_restore_point() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    send(b, a)
    send(a, b)  # b has a restore point, a has not published one yet
    assert rp(b) == 3
    assert b.status(STREAM).gc_horizon is None
    assert b.safe_to_delete(STREAM) == IntervalSet()


def test_gc_horizon_uses_the_lowest_restore_point() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    sync(a, b)
    commit(a, 4, 5)
    commit(b, 4, 5)
    send(b, a)
    send(a, b)  # b moves to 5, a still publishes 3
    assert rp(b) == 5
    assert b.status(STREAM).gc_horizon == 3
    assert b.safe_to_delete(STREAM) == IntervalSet.span(1, 2)


def test_retention_larger_than_the_restore_point_protects_everything() -> None:
    n = cluster(retention=10)
    commit(n["a"], 1, 2, 3)
    commit(n["b"], 1, 2, 3)
    sync(*n.values())
    assert n["a"].status(STREAM).gc_horizon == 0
    assert n["a"].safe_to_delete(STREAM) == IntervalSet()


def test_safe_to_delete_excludes_our_open_frozen_sets() -> None:
    n = cluster(retention=1)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    freeze = a.freeze_fact(STREAM, 1)
    assert freeze is not None
    assert freeze.epochs == IntervalSet.span(4, 5)  # cut at the floor 5 - 1
    a.apply(freeze)
    commit(a, *range(6, 10))
    commit(b, *range(6, 10))
    sync(a, b)
    assert a.status(STREAM).gc_horizon == 8
    assert a.safe_to_delete(STREAM) == IntervalSet.span(1, 3) | IntervalSet.span(6, 7)
    # b deletes nothing a froze either: a's record carries its frozen set.
    assert b.safe_to_delete(STREAM) == IntervalSet.span(1, 3) | IntervalSet.span(6, 7)


def test_retiring_a_safe_epoch_moves_neither_restore_point_nor_horizon() -> None:
    n = cluster(retention=1)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    assert a.safe_to_delete(STREAM) == IntervalSet.span(1, 3)
    a.apply(Retire(STREAM, 0, "nvme", 1))
    sync(a, b)
    assert a.status(STREAM).recoverable == IntervalSet.span(2, 5)
    assert rp(a) == rp(b) == 5
    assert a.status(STREAM).gc_horizon == b.status(STREAM).gc_horizon == 4
    assert a.safe_to_delete(STREAM) == IntervalSet.span(2, 3)  # 1 is gone: nothing to delete


# -- recovery generations ---------------------------------------------------------------------


def freeze(node: NodeCore, generation: int) -> Freeze:
    fact = node.freeze_fact(STREAM, generation)
    assert fact is not None
    node.apply(fact)
    return fact


def test_freeze_fact_is_issued_once_per_generation() -> None:
    node = cluster()["a"]
    commit(node, 1, 2)
    fact = freeze(node, 1)
    assert fact == Freeze(STREAM, 1, IntervalSet.of(1, 2))
    assert node.freeze_fact(STREAM, 1) is None
    assert node.status(STREAM).generations == (1,)


def test_generation_waits_for_every_members_frozen_set() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    freeze(a, 1)
    answer = a.generation(STREAM, 1)
    assert not answer.resolved
    assert answer.restore_point is None
    assert answer.waiting_for == ("b",)
    send(b, a)  # b's record, but no frozen set in it yet
    assert a.generation(STREAM, 1).waiting_for == ("b",)
    assert b.generation(STREAM, 1).waiting_for == ("a", "b")
    send(a, b)  # b knows a's frozen set, but has not frozen its own
    assert b.generation(STREAM, 1).waiting_for == ("b",)


def test_generation_resolves_to_the_newest_epoch_of_the_frozen_intersection() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3, 5)
    commit(b, 2, 3, 4, 5, 6)
    freeze(a, 1)
    freeze(b, 1)
    sync(a, b)
    answers = {m: node.generation(STREAM, 1) for m, node in n.items()}
    assert answers["a"] == answers["b"]
    assert answers["a"].resolved
    assert answers["a"].restore_point == 5
    assert GenerationResolved(STREAM, 1, 5) in events(a)


def test_every_member_returns_the_same_epoch_despite_late_commits() -> None:
    n = cluster("abc")
    for node in n.values():
        commit(node, 1, 2, 3)
    sync(*n.values())
    freeze(n["a"], 4)  # a freezes {1, 2, 3}
    for node in n.values():
        commit(node, 4, 5)  # late uploads keep committing
    freeze(n["b"], 4)
    freeze(n["c"], 4)  # b and c freeze {1..5}
    send(n["b"], n["c"])
    send(n["c"], n["b"])
    assert not n["b"].generation(STREAM, 4).resolved  # b never guesses without a's set
    sync(*n.values())
    answers = {node.generation(STREAM, 4).restore_point for node in n.values()}
    assert answers == {3}
    assert all(rp(node) == 5 for node in n.values())  # the live restore point moved on


def test_frozen_set_is_cut_at_the_rollback_floor() -> None:
    n = cluster(retention=2)
    commit(n["a"], *range(0, 10))
    commit(n["b"], *range(0, 10))
    sync(*n.values())
    assert freeze(n["a"], 1).epochs == IntervalSet.span(7, 9)


def test_a_newer_resolved_generation_closes_older_ones() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2)
    commit(b, 1, 2)
    freeze(a, 1)  # generation 1 never resolves: b never asks for it
    freeze(a, 2)
    freeze(b, 2)
    sync(a, b)
    assert a.generation(STREAM, 2).resolved
    assert a.status(STREAM).generations == (2,)
    with pytest.raises(GenerationClosedError) as info:
        a.generation(STREAM, 1)
    assert info.value.reason == "generation_closed"
    with pytest.raises(GenerationClosedError):
        a.freeze_fact(STREAM, 1)
    with pytest.raises(GenerationClosedError):
        b.freeze_fact(STREAM, 1)


def test_a_resolved_generation_keeps_its_answer_after_newer_ones_resolve() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    commit(a, 1, 2)
    commit(b, 1, 2)
    freeze(a, 1)
    freeze(b, 1)
    sync(a, b)
    commit(a, 3)
    commit(b, 3)
    freeze(a, 2)
    freeze(b, 2)
    sync(a, b)
    assert a.generation(STREAM, 2).restore_point == 3
    assert a.generation(STREAM, 1).restore_point == 2


def test_a_retraction_of_the_resolved_epoch_marks_the_generation_lost() -> None:
    n = cluster(retention=5)
    a, b = n["a"], n["b"]
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    sync(a, b)
    freeze(a, 1)
    freeze(b, 1)
    sync(a, b)
    assert not a.generation(STREAM, 1).lost
    retract(b, 3)
    sync(a, b)
    lost = a.generation(STREAM, 1)
    assert lost.resolved
    assert lost.restore_point == 3
    assert lost.lost
    freeze(a, 2)
    freeze(b, 2)
    sync(a, b)
    assert a.generation(STREAM, 2).restore_point == 2
    assert b.generation(STREAM, 2).restore_point == 2


def test_generations_with_no_common_epoch_resolve_to_none() -> None:
    n = cluster()
    commit(n["a"], 1)
    commit(n["b"], 2)
    freeze(n["a"], 1)
    freeze(n["b"], 1)
    sync(*n.values())
    answer = n["a"].generation(STREAM, 1)
    assert answer.resolved
    assert answer.restore_point is None


# -- spec conflicts ------------------------------------------------------------------------------


def test_a_member_with_another_spec_surfaces_as_a_conflict() -> None:
    a = cluster()["a"]
    commit(a, 1, 2)
    other = make_spec(retention=3)
    b = NodeCore("b", 1)
    b.apply(Declare(other))
    commit(b, 1, 2)
    send(b, a)
    status = a.status(STREAM)
    assert status.conflicts == (("b", other.digest.hex()),)
    assert status.knowledge is Knowledge.INCOMPLETE
    assert status.convergence is None
    assert status.restore_point is None
    assert status.missing == ()
    conflicts: list[NodeEvent] = [e for e in events(a) if isinstance(e, SpecConflictDetected)]
    assert conflicts == [SpecConflictDetected(STREAM, "b", other.digest)]


def test_a_conflict_is_reported_once_and_clears_when_the_member_matches_again() -> None:
    a = cluster()["a"]
    commit(a, 1, 2)
    b = NodeCore("b", 1)
    b.apply(Declare(make_spec(retention=3)))
    commit(b, 1, 2, 3)  # several versions of the conflicting record
    send(b, a)
    commit(b, 4)
    send(b, a)
    assert sum(isinstance(e, SpecConflictDetected) for e in events(a)) == 1
    b2 = NodeCore("b", 2)  # b restarts with the right spec
    b2.apply(Declare(make_spec()))
    commit(b2, 1, 2)
    sync(a, b2)
    status = a.status(STREAM)
    assert status.conflicts == ()
    assert status.restore_point == 2


def test_a_conflicting_member_record_gives_no_gc_horizon() -> None:
    n = cluster()
    commit(n["a"], 1, 2)
    commit(n["b"], 1, 2)
    sync(*n.values())
    b2 = NodeCore("b", 2)
    b2.apply(Declare(make_spec(retention=1)))
    send(b2, n["a"])
    assert n["a"].status(STREAM).gc_horizon is None
    assert n["a"].safe_to_delete(STREAM) == IntervalSet()


def test_published_recoverable_set_is_cut_to_the_wire_limit_newest_first() -> None:
    from convergenced.core.records import MAX_RANGES

    spec = StreamSpec.create("sparse", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    node = NodeCore("a", 1)
    node.apply(Declare(spec))
    for k in range(MAX_RANGES + 10):
        node.apply(Commit("sparse", 0, "nvme", 100 * k))  # every 100th step: one range each
    rec = node.own_record("sparse")
    assert rec is not None
    assert len(rec.recoverable.ranges) == MAX_RANGES
    assert rec.recoverable.max() == 100 * (MAX_RANGES + 9)
    assert 0 not in rec.recoverable
    # ... so a peer accepts it off the wire.
    Record.from_wire(rec.to_wire(), "rec")


def test_evicting_an_old_generation_closes_it_instead_of_refreezing() -> None:
    from convergenced.core.node import GenerationClosedError
    from convergenced.core.records import MAX_GENERATIONS

    spec = StreamSpec.create("gens", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    node = NodeCore("a", 1)
    node.apply(Declare(spec))
    node.apply(Commit("gens", 0, "nvme", 1))
    for g in range(1, MAX_GENERATIONS + 2):
        fact = node.freeze_fact("gens", g)
        assert fact is not None
        node.apply(fact)
    with pytest.raises(GenerationClosedError):
        node.freeze_fact("gens", 1)


def test_closing_old_generations_survives_a_restart() -> None:
    from convergenced.core.facts import CloseGenerations
    from convergenced.core.node import GenerationClosedError

    spec = StreamSpec.create("restart", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    a, b = NodeCore("a", 1), NodeCore("b", 1)
    log: list[Fact] = []

    def apply_a(fact: Fact) -> None:
        a.apply(fact)
        log.append(fact)

    apply_a(Declare(spec))
    b.apply(Declare(spec))
    apply_a(Commit("restart", 0, "nvme", 1))
    b.apply(Commit("restart", 1, "nvme", 1))
    for g in (1, 2):
        fa, fb = a.freeze_fact("restart", g), b.freeze_fact("restart", g)
        assert fa is not None and fb is not None
        apply_a(fa)
        b.apply(fb)
    a.receive(list(b.view))
    assert a.generation("restart", 2).resolved
    closes = [f for f in pending_facts(a) if isinstance(f, CloseGenerations)]
    assert closes[-1] == CloseGenerations("restart", 2)
    log.extend(pending_facts(a))

    restarted = NodeCore("a", 2)
    restarted.replay(log)
    with pytest.raises(GenerationClosedError):
        restarted.freeze_fact("restart", 1)
    with pytest.raises(GenerationClosedError):
        restarted.generation("restart", 1)


def test_members_that_freeze_apart_still_share_the_epoch_the_first_one_froze() -> None:
    # a asks first and freezes {5}; commits go on to 8; b asks later. Cut at its own
    # high-water mark alone, b would freeze {8}: disjoint sets, no restore point,
    # although 5 is on every member and nobody may delete it.
    n = cluster(retention=0)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    assert freeze(a, 1).epochs == IntervalSet.of(5)
    commit(a, 6, 7, 8)
    commit(b, 6, 7, 8)
    sync(a, b)
    assert rp(b) == 8
    assert freeze(b, 1).epochs == IntervalSet.of(5, 8)
    sync(a, b)
    assert a.generation(STREAM, 1).restore_point == b.generation(STREAM, 1).restore_point == 5


def test_a_frozen_set_takes_from_other_members_only_epochs_it_holds() -> None:
    n = cluster(retention=0)
    a, b = n["a"], n["b"]
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    freeze(a, 1)  # {5}
    retract(b, 5)  # b lost 5 meanwhile
    commit(a, 6)
    commit(b, 6)
    sync(a, b)
    assert 5 not in freeze(b, 1).epochs


def test_a_refused_declaration_is_visible_on_the_member_that_declared_first() -> None:
    """b already holds a's record when its client declares another spec: b refuses it,
    and a sees the conflict too (state, and the event the daemon logs and counts)."""
    first = StreamSpec.create("s", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    other = StreamSpec.create("s", {"a": [0], "b": [1]}, Policy.all_of("ram"))
    a, b = NodeCore("a", 1), NodeCore("b", 1)
    a.apply(Declare(first))
    b.receive(list(a.view), via="a")
    admission = Admission(b, OutputGate(b))
    with pytest.raises(ApiError) as info:
        admission.submit(Declare(other))
    assert info.value.reason == "spec_conflict"
    assert b.streams() == []  # refused: nothing declared
    a.receive(list(b.view), via="b")
    assert a.status("s").conflicts == (("b", other.digest.hex()),)
    assert SpecConflictDetected("s", "b", other.digest) in events(a)
    # b's client fixes its spec: b declares, its record supersedes the notice.
    admission.submit(Declare(first))
    a.receive(list(b.view), via="b")
    assert a.status("s").conflicts == ()
