"""A frozen set never keeps an epoch its node declared safe to delete (S4, sim seed 300122).

A member whose GC horizon lags (it has not seen every member's newest restore point
yet) freezes its set from that low horizon, below what the others' horizons already
passed. A member that froze later used to copy that set whole (`generations`, rule 1):
epochs it had already declared safe to delete, which its ranks may be deleting, went
into its own open frozen set, and could even become the generation's answer.
"""

from __future__ import annotations

from pulled import pending_facts

from convergenced.core.facts import Commit, Declare, Fact, Freeze, Retract
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec

STREAM = "job"
RANK = {"a": 0, "b": 1}
SPEC = StreamSpec.create(STREAM, {m: [r] for m, r in RANK.items()}, Policy.all_of("nvme"), 0)


class Node:
    """A core and the log of every fact applied to it, for a restart."""

    def __init__(self, name: str, incarnation: int = 1) -> None:
        self.core = NodeCore(name, incarnation)
        self.log: list[Fact] = []

    def apply(self, fact: Fact) -> None:
        self.core.apply(fact)
        self.log.append(fact)

    def commit(self, *epochs: int) -> None:
        for e in epochs:
            self.apply(Commit(STREAM, RANK[self.core.node_id], "nvme", e))

    def freeze(self, generation: int) -> IntervalSet:
        fact = self.core.freeze_fact(STREAM, generation)
        assert isinstance(fact, Freeze)
        self.apply(fact)
        return fact.epochs

    def durable_log(self) -> list[Fact]:
        return self.log + pending_facts(self.core)


def send(src: Node, dst: Node) -> None:
    dst.core.receive(list(src.core.view))


def lagging_freeze_then_declared() -> tuple[Node, Node, IntervalSet]:
    """a and b agree on 5; b computed horizon 5 and declared 1-4 safe to delete, while
    a, still at horizon 2 (b's restore point 5 has not reached it), froze 2-5."""
    a, b = Node("a"), Node("b")
    a.apply(Declare(SPEC))
    b.apply(Declare(SPEC))
    a.commit(1, 2)
    b.commit(1, 2)
    for src, dst in [(a, b), (b, a), (a, b), (b, a)]:
        send(src, dst)
    a.commit(3, 4, 5)
    b.commit(3, 4, 5)
    send(a, b)
    send(b, a)
    send(a, b)
    declared = b.core.safe_to_delete(STREAM)
    assert declared == IntervalSet.span(1, 4)
    assert a.freeze(1) == IntervalSet.span(2, 5)  # from a's own (lagging) horizon, 2
    send(a, b)
    return a, b, declared


def test_a_frozen_set_never_copies_epochs_its_node_declared_safe_to_delete() -> None:
    a, b, declared = lagging_freeze_then_declared()
    frozen = b.freeze(1)
    assert not frozen & declared  # was 2-4: b's ranks may be deleting them
    assert frozen == IntervalSet.of(5)
    send(b, a)
    assert a.core.generation(STREAM, 1).restore_point == 5
    assert b.core.generation(STREAM, 1).restore_point == 5


def test_a_generation_never_answers_an_epoch_a_member_declared_safe_to_delete() -> None:
    a, b, declared = lagging_freeze_then_declared()
    b.apply(Retract(STREAM, RANK["b"], "nvme", 5))  # b loses 5 before it freezes
    b.freeze(1)
    send(b, a)
    answer = b.core.generation(STREAM, 1)
    assert answer.resolved
    # It was 4, which b's ranks were told they may delete (S1, S4).
    assert answer.restore_point is None or answer.restore_point not in declared
    assert a.core.generation(STREAM, 1).restore_point == answer.restore_point


def test_after_a_restart_everything_below_the_durable_horizon_counts_as_declared() -> None:
    a, b, declared = lagging_freeze_then_declared()
    # b crashes after its answer left (its horizon was durable before that); the
    # rank that got the answer may still be deleting after the restart.
    restarted = Node("b", 2)
    restarted.core.replay(b.durable_log())
    send(a, restarted)
    assert not restarted.freeze(1) & declared
