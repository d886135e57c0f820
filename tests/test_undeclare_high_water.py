"""A redeclared stream keeps the rollback floor of the one undeclared before it.

Found by `convergenced sim --nodes 4 --seed 203389 --faults all` (S1): n03 published
restore point 30, so n01 deleted 26 and 27 (below its horizon 30 - 1). n03's job then
undeclared the stream and declared it again, finding its checkpoints and committing
them again. Undeclaring had forgotten n03's high-water mark, and n03's only record of
n01 was a relayed, older one (high-water mark 25, 26-27 still in its set): the
rollback floor came out at 24, and n03 reported 24, 25, 26... though n01 had deleted 26.

PROTOCOL.md 13.8 keeps S1 through a new first restore point with "restore points stay
at or above the node's own HW - r": every deletion anywhere is below HW(A) - r for
every member A, however stale the deleter's records. That needs HW(A) never to go
down, undeclaring included (7.4): the node keeps the mark of the stream it undeclares,
as it keeps its generation floor, and a later declaration of the name adopts it (it
bounds the rollback floor and never stands in for a restore point, as a mark adopted
after a lost state does, 13.9).
"""

from __future__ import annotations

from pulled import clear_events, events

from convergenced.core.events import RestorePointChanged
from convergenced.core.facts import Commit, Declare, Fact, HighWater, Retire, Undeclare
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("nvme"), retention=1)


class Logged:
    """A core and its write-ahead log (the facts applied, then those it produced)."""

    def __init__(self, core: NodeCore) -> None:
        self.core = core
        self.log: list[Fact] = []

    def apply(self, fact: Fact) -> None:
        self.core.apply(fact)
        self.log.append(fact)
        self.log.extend(self.core.take_pending_facts())

    def receive(self, src: NodeCore) -> None:
        send(src, self.core)
        self.log.extend(self.core.take_pending_facts())


def send(src: NodeCore, dst: NodeCore) -> None:
    dst.receive(list(src.view), via=src.node_id)


def stale_view_then_deletion() -> tuple[Logged, NodeCore]:
    """a reaches restore point 6 on a record of b that says high-water mark 3; b then
    sees a's 6 and deletes 1-4, but a never hears of b again."""
    a, b = Logged(NodeCore("a", 1)), NodeCore("b", 1)
    a.apply(Declare(SPEC))
    b.apply(Declare(SPEC))
    for e in (1, 2, 3):
        a.apply(Commit("job", 0, "nvme", e))
        b.apply(Commit("job", 1, "nvme", e))
    for _ in range(3):
        send(a.core, b)
        a.receive(b)
    assert a.core.restore_point("job") == b.restore_point("job") == 3
    for e in (4, 5, 6):
        a.apply(Commit("job", 0, "nvme", e))
        b.apply(Commit("job", 1, "nvme", e))
    send(a.core, b)  # b proposes 6; its restore point stays 3 (a proposed 3)
    a.receive(b)  # the last record of b that a will hold
    assert a.core.restore_point("job") == 6
    stale = a.core.view.get(("job", "b"))
    assert stale is not None and stale.high_water == 3 and 4 in stale.recoverable
    send(a.core, b)
    assert b.restore_point("job") == 6
    deletable = b.safe_to_delete("job")
    assert list(deletable) == [1, 2, 3, 4]  # below b's horizon 6 - 1
    for e in deletable:
        b.apply(Retire("job", 1, "nvme", e))
    return a, b


def redeclare_and_recommit(a: NodeCore) -> list[int | None]:
    """a's job declares the stream again and commits the checkpoints it finds; the
    restore points it then reports."""
    clear_events(a)
    a.apply(Declare(SPEC))
    for e in range(1, 7):
        a.apply(Commit("job", 0, "nvme", e))
    return [ev.new for ev in events(a) if isinstance(ev, RestorePointChanged)]


def test_a_redeclared_stream_never_reports_what_a_member_deleted_by_its_old_mark() -> None:
    a, b = stale_view_then_deletion()
    a.apply(Undeclare("job"))  # its tombstone need not reach b for this
    reported = redeclare_and_recommit(a.core)
    assert reported, "a reaches a restore point again"
    held = b.status("job").recoverable
    assert all(rp is not None and rp in held for rp in reported), (reported, held)
    assert reported[0] == 5  # the floor is 6 - 1: the old mark, adopted
    assert a.core.status("job").high_water == 6


def test_the_kept_mark_survives_a_restart_from_the_full_or_the_compacted_log() -> None:
    a, b = stale_view_then_deletion()
    a.apply(Undeclare("job"))
    compacted = a.core.compacted_facts()
    assert [f for f in compacted if isinstance(f, HighWater)] == [
        HighWater("job", 6, (("a", 0, 0),), None)
    ]
    held = b.status("job").recoverable
    for log in (a.log, compacted):
        again = NodeCore("a", 2)
        again.replay(log)
        assert again.streams() == []
        again.receive([r for r in a.core.view if r.origin == "b"], via="c")  # the stale one
        reported = redeclare_and_recommit(again)
        assert reported and all(rp is not None and rp in held for rp in reported), reported


def test_the_adopted_mark_never_stands_in_for_a_restore_point() -> None:
    # The new job may not hold the old one's checkpoints: after a restart, the kept
    # mark bounds the floor but the node chooses its point in the interval again.
    a, _ = stale_view_then_deletion()
    a.apply(Undeclare("job"))
    a.apply(Declare(SPEC))
    again = NodeCore("a", 2)
    again.replay([*a.log, *a.core.take_pending_facts()])
    assert again.restore_point("job") is None
    st = again.status("job")
    assert st.high_water == 6
