"""A node that lost its state numbers a relaunch only once it holds its members' own
records (simulator seed 206217, S2).

A generation resolves only with every member's frozen set, so every member that kept
its log remembers it (open, resolved or closed below a newer one), and its own record
carries it. The node that lost its state learns its past from the records of its
origin its peers hold (`lives`, rules 2 and 3); but when the members that resolved a
generation lost their state too and the others restarted since (a restart rebuilds
the view of others from scratch), no peer holds the record of it that carried its
frozen set any more. Then only the members' own records tell the generation is
taken: a number handed out before they arrive could be one a member resolved already.
The node waits for them before it settles the stream, and keeps what they showed as
taken in its `Settled` fact, so a restart that no longer waits still numbers above it.
Core only, no I/O.
"""

from __future__ import annotations

from pulled import pending_facts

from convergenced.core.facts import Commit, Declare, Fact, Settled
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import decode_entry, encode_entry

STREAM = "job"
RANK = {"a": 0, "b": 1, "c": 2}
SPEC = StreamSpec.create(STREAM, {m: [r] for m, r in RANK.items()}, Policy.all_of("nvme"), 0)


def node(name: str, incarnation: int = 1, *, unsure: bool = False) -> NodeCore:
    n = NodeCore(name, incarnation, unsure_of_past=unsure)
    n.apply(Declare(SPEC))
    for e in range(1, 6):
        n.apply(Commit(STREAM, RANK[name], "nvme", e))
    return n


def sync(*nodes: NodeCore) -> None:
    for _ in range(10):
        for src in nodes:
            for dst in nodes:
                if src is not dst:
                    dst.receive(list(src.view), via=src.node_id)


def hello(receiver: NodeCore, sender: NodeCore) -> None:
    """``receiver`` gets ``sender``'s HELLO (its summary of what it holds)."""
    summary = sender.hello_summary(first=receiver.node_id)
    receiver.hello_from(sender.node_id, sender.incarnation, summary)


def freeze(n: NodeCore, generation: int) -> Fact:
    fact = n.freeze_fact(STREAM, generation)
    assert fact is not None
    n.apply(fact)
    return fact


def after_the_resolvers_lost_their_state() -> tuple[NodeCore, NodeCore, NodeCore]:
    """Every member froze generation 1 and a and b resolved it; c crashed before it
    heard the others' sets (it kept its log, but its view of the others is gone); then
    b, and later a, lost their state directories. Returns the new a, the new b (both
    unsure of their past) and the restarted c."""
    a, b, c = node("a"), node("b"), node("c")
    sync(a, b, c)
    c_frozen = freeze(c, 1)
    sync(a, b, c)
    freeze(a, 1)
    freeze(b, 1)
    sync(a, b)
    assert a.generation(STREAM, 1).restore_point == b.generation(STREAM, 1).restore_point == 5
    c_log: list[Fact] = [Declare(SPEC), *(Commit(STREAM, 2, "nvme", e) for e in range(1, 6))]
    c_again = NodeCore("c", 2)  # kill -9 of c, and a restart from its log
    c_again.replay([*c_log, c_frozen])
    assert c_again.view.get((STREAM, "a")) is None  # what it held of a went with it
    return node("a", 1, unsure=True), node("b", 1, unsure=True), c_again


def test_it_waits_for_the_members_own_records_before_numbering_a_relaunch() -> None:
    a, b, c = after_the_resolvers_lost_their_state()
    hello(a, b)  # unsure of its past too: b publishes nothing yet
    hello(a, c)  # no peer holds a record of a, but c announced its own
    # Before the fix a settled here and numbered 1: a generation a and b resolved to
    # 5 in their lost lives. Only c's own record, which carries it, tells.
    assert a.waiting_to_freeze(STREAM) == ("c",)
    assert a.next_generation(STREAM) is None
    a.receive(list(c.view), via="c")
    assert a.waiting_to_freeze(STREAM) == ()
    assert a.next_generation(STREAM) == 2
    assert Settled(STREAM, 2) in pending_facts(a)


def test_what_it_learned_is_taken_after_a_restart_that_forgot_the_view() -> None:
    a, b, c = after_the_resolvers_lost_their_state()
    hello(a, b)
    hello(a, c)
    a.receive(list(c.view), via="c")
    log: list[Fact] = [a.incarnation_fact(), Declare(SPEC), *pending_facts(a)]
    again = NodeCore("a", a.incarnation + 1)  # kill -9 of a, and a restart from its log
    again.replay(log)
    assert again.view.get((STREAM, "c")) is None and again.waiting_to_freeze(STREAM) == ()
    assert again.next_generation(STREAM) == 2
    # Compaction keeps it, and so does the log's encoding.
    compacted = again.compacted_facts()
    assert Settled(STREAM, 2) in compacted
    assert [decode_entry(encode_entry(f)) for f in compacted] == compacted
    third = NodeCore("a", again.incarnation + 1)
    third.replay(compacted)
    assert third.next_generation(STREAM) == 2


def test_a_node_that_kept_its_log_does_not_wait_for_its_members_records() -> None:
    *_, c = after_the_resolvers_lost_their_state()
    assert c.waiting_to_freeze(STREAM) == ()
    assert c.next_generation(STREAM) == 2  # its log holds generation 1


def test_a_peer_that_announced_no_record_of_its_own_is_not_waited_for() -> None:
    a, b, c = after_the_resolvers_lost_their_state()
    assert b.own_record(STREAM) is None  # b, unsure too, publishes nothing yet
    hello(a, b)
    hello(a, c)
    a.receive(list(c.view), via="c")
    assert a.waiting_to_freeze(STREAM) == ()


def test_a_hello_summary_lists_the_senders_own_records_after_the_expected_peers() -> None:
    """A cut summary keeps them: a node that lost its state waits for what it lists."""
    a, b, c = node("a"), node("b"), node("c")
    sync(a, b, c)
    summary = c.hello_summary(first="a")
    assert [o for _, o, _, _ in summary] == ["a", "c", "b"]
