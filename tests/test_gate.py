"""The output gate: no byte leaves before the fsync that covers every fact it reveals."""

from __future__ import annotations

import pytest

from convergenced.core.errors import FactError
from convergenced.core.facts import Commit, Declare, HighWater, Horizon
from convergenced.core.gate import OutputGate
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

SPEC = StreamSpec.create("job", {"a": [0]}, Policy.all_of("nvme"))


def gated() -> tuple[NodeCore, OutputGate]:
    node = NodeCore("a", 1)
    gate = OutputGate(node)
    gate.apply(Declare(SPEC))
    return node, gate


def test_bytes_wait_for_the_fsync_of_every_fact_applied_before_them() -> None:
    _, gate = gated()
    out = gate.output()
    out.send(b"reveals the declaration")
    assert out.release() == []
    facts, upto = gate.take_unlogged()
    assert facts == [Declare(SPEC)] and upto == 1
    gate.synced(upto)
    assert out.release() == [b"reveals the declaration"]


def test_bytes_queued_during_an_fsync_wait_for_the_next_one() -> None:
    # The bug this gate exists for: a fact applied while an fsync runs must not ride
    # out on it with bytes that were queued after the fact.
    _, gate = gated()
    out = gate.output()
    _, upto = gate.take_unlogged()  # the write of the declaration is in flight
    gate.apply(Commit("job", 0, "nvme", 1))
    out.send(b"reveals the commit")
    gate.synced(upto)  # the declaration is durable, the commit is not
    assert out.release() == []
    facts, upto = gate.take_unlogged()
    # The core's own mark too, and the GC horizon it now has.
    assert [type(f) for f in facts] == [Commit, HighWater, Horizon]
    gate.synced(upto)
    assert out.release() == [b"reveals the commit"]


def test_a_mark_the_core_raised_on_a_peers_record_holds_the_next_bytes() -> None:
    # The core itself produces facts while it merges records from a peer: the gate
    # takes them the moment it is asked for a position, before tagging any byte.
    pair = StreamSpec.create("pair", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    node = NodeCore("a", 1)
    gate = OutputGate(node)
    gate.apply(Declare(pair))
    gate.apply(Commit("pair", 0, "nvme", 4))
    gate.synced(gate.take_unlogged()[1])
    peer = NodeCore("b", 1)
    peer.apply(Declare(pair))
    peer.apply(Commit("pair", 1, "nvme", 4))
    out = gate.output()
    for _ in range(3):  # proposals, then the restore point: a high-water mark
        node.receive(list(peer.view))
        peer.receive(list(node.view))
    assert node.restore_point("pair") == 4
    out.send(b"reveals restore point 4")
    assert out.release() == []
    facts, upto = gate.take_unlogged()
    assert HighWater in {type(f) for f in facts}
    gate.synced(upto)
    assert out.release() == [b"reveals restore point 4"]


def test_chunks_leave_in_order_and_each_output_on_its_own() -> None:
    _, gate = gated()
    a, b = gate.output(), gate.output()
    b.send(b"b1")
    gate.synced(gate.take_unlogged()[1])
    a.send(b"a1")  # nothing new applied: may leave at once
    gate.apply(Commit("job", 0, "nvme", 1))
    a.send(b"a2")
    a.send(b"a3")
    assert a.waiting_for == gate.position()
    assert a.releasable() == 1
    assert a.release() == [b"a1"]
    assert b.release() == [b"b1"]
    gate.synced(gate.take_unlogged()[1])
    assert a.release() == [b"a2", b"a3"]
    assert len(a) == 0 and a.waiting_for == 0


def test_a_refused_fact_is_not_logged_and_holds_nothing_back() -> None:
    _, gate = gated()
    gate.synced(gate.take_unlogged()[1])
    out = gate.output()
    with pytest.raises(FactError):
        gate.apply(Commit("job", 9, "nvme", 1))  # rank 9 is not ours
    assert not gate.pending()
    out.send(b"the refusal")
    assert out.release() == [b"the refusal"]
