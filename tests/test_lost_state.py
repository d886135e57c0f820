"""A node that lost its state directory: it hears of its last life from its peers, rises
above it, keeps what that life published for others (its high-water mark, its frozen
sets), and says honestly what it holds now. Core and links, no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from pulled import events, pending_facts

from convergenced.core.events import StateLost
from convergenced.core.facts import (
    Commit,
    Declare,
    Fact,
    Freeze,
    HighWater,
    Incarnation,
    Settled,
    Undeclare,
)
from convergenced.core.interval_set import IntervalSet
from convergenced.core.link import Link, LinkConfig, Role
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.core.spec import Policy, StreamSpec

STREAM = "job"
SPEC = StreamSpec.create(STREAM, {"a": [0], "b": [1]}, Policy.all_of("nvme"), retention=1)


def node(name: str, incarnation: int = 1, *, unsure: bool = False) -> NodeCore:
    n = NodeCore(name, incarnation, unsure_of_past=unsure)
    n.apply(Declare(SPEC))
    return n


def commit(n: NodeCore, *epochs: int) -> None:
    rank = 0 if n.node_id == "a" else 1
    for e in epochs:
        n.apply(Commit(STREAM, rank, "nvme", e))


def sync(*nodes: NodeCore) -> None:
    for _ in range(10):
        for src in nodes:
            for dst in nodes:
                if src is not dst:
                    dst.receive(list(src.view), via=src.node_id)


def hello(receiver: NodeCore, sender: NodeCore) -> None:
    """``receiver`` gets ``sender``'s HELLO (its summary of what it holds)."""
    summary = [(r.stream, r.origin, r.incarnation, r.version) for r in sender.view]
    receiver.hello_from(sender.node_id, sender.incarnation, summary)


def a_life_that_froze_and_was_lost() -> tuple[NodeCore, NodeCore, IntervalSet]:
    """a and b agreed on 5, a froze generation 1 and b resolved it; then a's state
    directory is lost. Returns b and the new a (unsure of its past) and a's old set."""
    a, b = node("a", 3), node("b")
    commit(a, *range(1, 6))
    commit(b, *range(1, 6))
    sync(a, b)
    frozen = a.freeze_fact(STREAM, 1)
    assert frozen is not None
    a.apply(frozen)
    b.apply(b.freeze_fact(STREAM, 1) or frozen)
    sync(a, b)
    assert b.generation(STREAM, 1).restore_point == 5
    fresh = node("a", 1, unsure=True)  # an empty state directory: incarnation 1 again
    commit(fresh, 4, 5)  # what the files integration finds on its disks and re-commits
    return b, fresh, frozen.epochs


def test_until_it_has_heard_from_every_member_it_publishes_and_deletes_nothing() -> None:
    b, a, _ = a_life_that_froze_and_was_lost()
    assert a.own_record(STREAM) is None
    assert a.safe_to_delete(STREAM) == IntervalSet()
    assert a.waiting_to_freeze(STREAM) == ("b",)
    assert a.freeze_fact(STREAM, 2) is None
    hello(a, b)  # b holds a record of a: a waits for it
    assert a.own_record(STREAM) is None and a.waiting_to_freeze(STREAM) == ("b",)
    a.receive(list(b.view), via="b")
    assert a.waiting_to_freeze(STREAM) == ()
    assert a.own_record(STREAM) is not None


def test_it_rises_above_its_last_life_and_adopts_its_mark_and_frozen_sets() -> None:
    b, a, old_set = a_life_that_froze_and_was_lost()
    hello(a, b)
    a.receive(list(b.view), via="b")
    assert a.incarnation == 4
    assert StateLost(3, 4) in events(a)
    facts = pending_facts(a)
    assert Incarnation(4, unsure=True) in facts
    assert any(isinstance(f, HighWater) and f.epoch == 5 for f in facts)
    assert Freeze(STREAM, 1, old_set) in facts
    mine = a.own_record(STREAM)
    assert mine is not None and mine.incarnation == 4
    assert mine.recoverable == IntervalSet.span(4, 5)  # what it holds now, honestly
    assert mine.generations == ((1, old_set),)
    sync(a, b)
    assert b.view.get((STREAM, "a")) == mine
    # Generation 1 keeps its inputs, so a answers what b answered (S2).
    assert a.generation(STREAM, 1).restore_point == b.generation(STREAM, 1).restore_point == 5


def test_a_crash_before_it_heard_from_every_member_leaves_it_unsure() -> None:
    """Its log then holds nothing of its past: a restart from that log must wait and
    learn it again, not act as if the log were all there was (the simulator found a
    node handing out a generation already resolved)."""
    b, a, old_set = a_life_that_froze_and_was_lost()
    log: list[Fact] = [a.incarnation_fact(), Declare(SPEC), *pending_facts(a)]
    assert log[0] == Incarnation(1, unsure=True)
    again = NodeCore("a", 2)  # a log exists: the daemon starts it as knowing its past
    again.replay(log)
    assert again.waiting_to_freeze(STREAM) == ("b",)
    assert again.next_generation(STREAM) is None and again.freeze_fact(STREAM, 2) is None
    hello(again, b)
    again.receive(list(b.view), via="b")
    assert again.waiting_to_freeze(STREAM) == ()
    facts = pending_facts(again)
    # Settled keeps generation 1, which b's record shows, as taken (rule 4).
    assert Freeze(STREAM, 1, old_set) in facts and Settled(STREAM, 2) in facts
    assert again.next_generation(STREAM) == 2
    # Once settled, the next restart knows its past and waits for no one.
    third = NodeCore("a", 5)
    third.replay([*log, *facts])
    assert third.waiting_to_freeze(STREAM) == () and third.incarnation_fact().unsure is False


def test_a_node_that_replayed_its_log_does_not_wait() -> None:
    a = node("a", 4)  # incarnation 4: it remembers lives 1 to 3
    assert a.own_record(STREAM) is not None
    assert a.waiting_to_freeze(STREAM) == ()


def test_a_new_node_waits_only_for_the_members_it_links_to() -> None:
    spec = StreamSpec.create("wide", {"a": [0], "b": [1], "c": [2]}, Policy.all_of("nvme"))
    a = NodeCore("a", 1, unsure_of_past=True)
    a.plan_links(["b"])  # an overlay: c is reached through b
    a.apply(Declare(spec))
    assert a.waiting_to_freeze("wide") == ("b",)
    a.hello_from("b", 1, [])
    assert a.waiting_to_freeze("wide") == ()
    assert a.own_record("wide") is not None


@dataclass
class Wire:
    """Two links, a's and b's, with bytes carried by hand."""

    la: Link
    lb: Link

    def settle(self) -> None:
        for _ in range(20):
            moved = False
            for src, dst in ((self.la, self.lb), (self.lb, self.la)):
                data = src.data_to_send()
                if data:
                    dst.receive_data(data)
                    moved = True
            if not moved:
                for link in (self.la, self.lb):
                    link.on_timer()


def test_a_peer_sends_a_node_its_lost_life_and_never_bounces_its_current_records() -> None:
    b, a, _ = a_life_that_froze_and_was_lost()
    wire = Wire(
        Link(a, Role.INITIATOR, LinkConfig(cluster="c", expected_peer="b", dead_ticks=1000)),
        Link(b, Role.ACCEPTOR, LinkConfig(cluster="c", expected_peer="a", dead_ticks=1000)),
    )
    wire.la.start()
    wire.lb.start()
    wire.settle()
    assert a.incarnation == 4 and a.own_record(STREAM) is not None
    assert b.view.get((STREAM, "a")) == a.own_record(STREAM)
    sent_before = wire.lb.records_sent
    commit(a, 6)
    wire.la.poll()
    wire.settle()
    assert b.view.get((STREAM, "a")) == a.own_record(STREAM)
    # b sent a none of a's own records since: known stamps stop the bounce.
    assert wire.lb.records_sent - sent_before <= 2  # b's own, as its state moved


def test_a_hello_summary_lists_the_expected_peers_records_first() -> None:
    b = node("b")
    b.receive([*(_other(f"x{i}") for i in range(5)), _other("a")])
    link = Link(b, Role.INITIATOR, LinkConfig(cluster="c", expected_peer="a"))
    assert link._hello().summary[0][1] == "a"


def _other(origin: str) -> Record:
    other = NodeCore(origin, 1)
    other.apply(Declare(StreamSpec.create("relayed", {origin: [0]}, Policy.all_of("nvme"))))
    rec = other.own_record("relayed")
    assert rec is not None
    return rec


def test_its_old_high_water_mark_comes_back_even_when_it_holds_nothing() -> None:
    b, _, _ = a_life_that_froze_and_was_lost()
    a = node("a", 1, unsure=True)  # and its disks are empty too
    hello(a, b)
    a.receive(list(b.view), via="b")
    assert any(isinstance(f, HighWater) and f.epoch == 5 for f in pending_facts(a))
    assert a.status(STREAM).high_water == 5
    assert a.status(STREAM).recoverable == IntervalSet()


def three_lives_at_2() -> tuple[StreamSpec, list[NodeCore]]:
    """a, b and c, each with one rank, committed 1 and 2 and agreed: the lives a
    lost-state test starts from."""
    spec = StreamSpec.create(STREAM, {"a": [0], "b": [1], "c": [2]}, Policy.all_of("nvme"))
    old = [NodeCore(m, 1) for m in "abc"]
    for rank, n in enumerate(old):
        n.apply(Declare(spec))
        for e in (1, 2):
            n.apply(Commit(STREAM, rank, "nvme", e))
    sync(*old)
    return spec, old


def test_an_adopted_mark_never_stands_in_for_a_restore_point() -> None:
    """The newest record of a lost life anyone still holds may be older than the one
    the others collected garbage by: a mark taken from it bounds the rollback floor,
    but is never reported as a restore point, in this life or after a restart."""
    spec, old = three_lives_at_2()
    stale = old[0].own_record(STREAM)
    assert stale is not None and stale.high_water == 2
    relay = NodeCore("b", 1)  # a peer that only ever heard the stale record
    relay.receive([stale], via="a")
    a = NodeCore("a", 1, unsure_of_past=True)
    a.plan_links(["b"])  # c is out of reach: nothing new is known of the interval
    a.apply(Declare(spec))
    a.apply(Commit(STREAM, 0, "nvme", 5))
    hello(a, relay)
    a.receive(list(relay.view), via="b")
    assert a.status(STREAM).high_water == 2
    assert a.restore_point(STREAM) is None
    again = NodeCore("a", a.incarnation + 1)
    again.replay([Declare(spec), Commit(STREAM, 0, "nvme", 5), *pending_facts(a)])
    assert again.status(STREAM).high_water == 2
    assert again.restore_point(STREAM) is None


def test_an_adopted_mark_this_life_reaches_stands_in_after_compaction_too() -> None:
    """The mark a node adopted from its lost life, then reached itself in this one, is
    its own: after a restart it stands in for the restore point, whether the log was
    compacted or not (a compacted log once brought it back as adopted only, and the
    node then reported a lower point as a rise: an S3 violation the simulator found,
    seed 420107)."""
    spec, old = three_lives_at_2()
    a = NodeCore("a", 1, unsure_of_past=True)
    a.plan_links(["b", "c"])
    log: list[Fact] = [Declare(spec), Commit(STREAM, 0, "nvme", 1), Commit(STREAM, 0, "nvme", 2)]
    for fact in log:
        a.apply(fact)
    for peer in old[1:]:
        hello(a, peer)
    sync(a, *old[1:])
    assert a.restore_point(STREAM) == 2 and a.status(STREAM).high_water == 2
    log += pending_facts(a)
    # The mark is still marked adopted (this node in its evidence) while this life
    # reached it too.
    assert any(isinstance(f, HighWater) and "a" in [m for m, _, _ in f.evidence] for f in log)
    for facts in (log, [Incarnation(a.incarnation), *a.compacted_facts()]):
        again = NodeCore("a", a.incarnation + 1)
        again.replay([f for f in facts if not isinstance(f, Incarnation)])
        assert again.status(STREAM).high_water == 2
        assert again.restore_point(STREAM) == 2, facts


def _restarted(n: NodeCore, facts: list[Fact]) -> NodeCore:
    """``n`` after a restart from a log of ``facts``: its view of others is gone."""
    again = NodeCore(n.node_id, n.incarnation + 1)
    again.replay(facts)
    return again


def test_a_record_from_its_origin_below_our_evidence_says_the_origin_lost_its_state() -> None:
    """b's log keeps the stamp of a's record its high-water mark rested on; a loses its
    state and the floor beside its key (it starts at incarnation 1 again) while b,
    restarted, holds no record of a's last life to tell it of. a's new records are
    below b's evidence: sent by a itself, they are current, not stale relays."""
    a, b = node("a"), node("b")
    commit(a, 1, 2, 3)
    commit(b, 1, 2, 3)
    sync(a, b)
    assert b.restore_point(STREAM) == 3
    last = a.own_record(STREAM)
    assert last is not None and last.version > 1
    b2 = _restarted(b, [Declare(SPEC), *(Commit(STREAM, 1, "nvme", e) for e in (1, 2, 3)),
                        *pending_facts(b)])  # fmt: skip
    a2 = node("a", 1, unsure=True)
    commit(a2, 1, 2, 3)
    hello(a2, b2)
    a2.told_all_of_ours("b")
    a2.receive([r for r in b2.view if r.origin == "b"], via="b")  # b's own (rule 4)
    mine = a2.own_record(STREAM)
    assert mine is not None and mine.stamp < last.stamp
    b2.receive([mine], via="c")  # a relay: still below the evidence, still ignored
    assert b2.status(STREAM).convergence is None
    b2.receive([mine], via="a")
    assert b2.status(STREAM).convergence == IntervalSet.span(1, 3)
    sync(a2, b2)
    assert a2.restore_point(STREAM) == b2.restore_point(STREAM) == 3


def test_a_node_never_sends_a_record_of_its_own_from_a_life_it_lost() -> None:
    """Until it has heard from every member, the newest record of a's origin in its view
    is its lost life's; a relays it to nobody (from a, it would pass for a's own)."""
    spec = StreamSpec.create("wide", {"a": [0], "b": [1], "c": [2]}, Policy.all_of("nvme"))
    old = NodeCore("a", 3)
    old.apply(Declare(spec))
    last = old.own_record("wide")
    assert last is not None
    a = NodeCore("a", 1, unsure_of_past=True)
    a.apply(Declare(spec))
    link = Link(a, Role.INITIATOR, LinkConfig(cluster="c", expected_peer="c"))
    a.receive([last], via="b")
    assert a.incarnation == 4 and a.waiting_to_freeze("wide") == ("b", "c")
    assert a.view.get(("wide", "a")) == last
    assert all(r.origin != "a" for r in link._deltas())


def test_a_log_of_an_unsure_life_then_a_sure_one_that_undeclared_replays() -> None:
    """Life 1 started without its log and settled ``job``; life 2 (sure of its past)
    declared ``other`` and undeclared it. A replay is unsure from life 1's
    Incarnation while it reads life 2's facts, so ``other`` is not settled again when
    its undeclaration comes: the undeclaration, accepted when it was logged, must
    replay all the same (it raised unsure_of_past and stopped the daemon's start)."""
    spec = StreamSpec.create("job", {"a": [0]}, Policy.all_of("nvme"))
    other = StreamSpec.create("other", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    log = [Incarnation(1, unsure=True), Declare(spec), Settled("job"),
           Incarnation(2), Declare(other), Undeclare("other")]  # fmt: skip
    node = NodeCore("a", 3)
    node.replay(log)
    assert node.streams() == ["job"]
