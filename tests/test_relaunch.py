"""Relaunches without a counter that grows forever: `NodeCore.next_generation`.

A launcher's restart counter starts again at 0 with every new launch (a requeue, a
new attempt, a rerun), so a job that named its generation by it got the final answer
of an older launch, or a closed generation. Instead one rank of the new launch asks
its daemon for a new generation and hands it to the others: a number above every
generation any member resolved or closed. Core only, no I/O.
"""

from __future__ import annotations

import pytest

from convergenced.core.facts import Commit, Declare, Freeze, Retire
from convergenced.core.generations import GenerationClosedError, GenerationsExhaustedError
from convergenced.core.interval_set import IntervalSet
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.core.validate import INT64_MAX

STREAM = "job"
RANK = {"a": 0, "b": 1, "c": 2}


def cluster(members: str = "ab", *, unsure: str = "") -> dict[str, NodeCore]:
    spec = StreamSpec.create(STREAM, {m: [RANK[m]] for m in members}, Policy.all_of("nvme"), 0)
    nodes = {}
    for m in members:
        nodes[m] = NodeCore(m, 1, unsure_of_past=m in unsure)
        nodes[m].apply(Declare(spec))
    return nodes


def commit(node: NodeCore, *epochs: int) -> None:
    for e in epochs:
        node.apply(Commit(STREAM, RANK[node.node_id], "nvme", e))


def sync(*nodes: NodeCore) -> None:
    for _ in range(20):
        changed = False
        for src in nodes:
            for dst in nodes:
                if src is not dst and dst.receive(list(src.view), via=src.node_id):
                    changed = True
        if not changed:
            return
    raise AssertionError("records did not stop changing")


def freeze(node: NodeCore, generation: int) -> None:
    fact = node.freeze_fact(STREAM, generation)
    assert fact is not None
    node.apply(fact)


def launch(nodes: dict[str, NodeCore], opener: str = "a") -> int:
    """One launch: ``opener`` asks for a new generation, every member freezes it."""
    generation = nodes[opener].next_generation(STREAM)
    assert generation is not None
    for node in nodes.values():
        freeze(node, generation)
    sync(*nodes.values())
    return generation


def collect(node: NodeCore) -> None:
    """The rank deletes (retires) what its daemon says is safe."""
    for e in node.safe_to_delete(STREAM):
        node.apply(Retire(STREAM, RANK[node.node_id], "nvme", e))


def test_the_first_generation_is_1_and_asking_changes_nothing() -> None:
    a = cluster()["a"]
    # Above the membership declared (0), so the launch may declare a new member map.
    assert a.next_generation(STREAM) == 1
    assert a.next_generation(STREAM) == 1  # nothing was frozen: the same number
    assert a.take_pending_facts() == [] and a.status(STREAM).generations == ()


def test_a_new_generation_is_above_every_one_known_here_and_in_members_records() -> None:
    n = cluster("abc")
    a, b, c = n["a"], n["b"], n["c"]
    freeze(a, 3)
    assert a.next_generation(STREAM) == 4
    freeze(c, 9)  # a generation of which only c's record tells
    sync(a, c)
    assert a.next_generation(STREAM) == 10
    assert b.next_generation(STREAM) == 1  # b has heard of none of them yet
    sync(a, b)
    assert b.next_generation(STREAM) == 10


def test_a_relaunch_restores_the_newest_agreed_epoch_where_counter_0_got_an_old_answer() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    first = launch(n)  # the first launch: nothing to restore yet
    assert a.generation(STREAM, first).restore_point is None
    for node in n.values():
        commit(node, 10, 20, 30)
    sync(a, b)
    for node in n.values():
        collect(node)  # 10 and 20 are retired: a rerun from scratch would re-save them
    sync(a, b)
    # The launcher's counter is back where the first launch's was: that generation's
    # answer is final.
    assert first == 1 and a.generation(STREAM, 1).restore_point is None
    second = launch(n, opener="b")  # rank 0 runs on another node this time
    assert second == 2
    assert {node.generation(STREAM, second).restore_point for node in n.values()} == {30}


def test_generations_closed_here_are_never_handed_out_again() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    for node in n.values():
        commit(node, 1)
    sync(a, b)
    freeze(a, 5)  # generation 5 never resolves: b's ranks never ask for it
    for node in n.values():
        freeze(node, 7)
    sync(a, b)
    assert a.status(STREAM).generations == (7,)
    with pytest.raises(GenerationClosedError, match="next_generation"):
        a.freeze_fact(STREAM, 5)
    assert a.next_generation(STREAM) == 8


def test_two_quick_relaunches_take_the_newer_generation_and_close_the_older() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    for node in n.values():
        commit(node, 1, 2)
    sync(a, b)
    first = a.next_generation(STREAM)
    assert first is not None
    freeze(a, first)  # the launch dies before b's ranks ask
    sync(a, b)
    second = b.next_generation(STREAM)  # the next launch's rank 0 runs on b
    assert second == first + 1
    freeze(b, second)
    freeze(a, second)
    sync(a, b)
    assert a.generation(STREAM, second).restore_point == 2
    assert a.status(STREAM).generations == b.status(STREAM).generations == (second,)


def test_a_node_that_lost_its_state_hands_out_nothing_until_it_heard_its_peers() -> None:
    n = cluster()
    a, b = n["a"], n["b"]
    for node in n.values():
        commit(node, 1, 2)
    sync(a, b)
    used = launch(n)
    assert a.generation(STREAM, used).resolved
    fresh = cluster(unsure="a")["a"]  # a's state directory is gone: incarnation 1 again
    commit(fresh, 1, 2)
    assert fresh.next_generation(STREAM) is None  # it may not know what it froze
    assert fresh.waiting_to_freeze(STREAM) == ("b",)
    summary = [(r.stream, r.origin, r.incarnation, r.version) for r in b.view]
    fresh.hello_from("b", b.incarnation, summary)  # b's HELLO: it holds a record of a
    assert fresh.next_generation(STREAM) is None  # ... which has not arrived yet
    sync(fresh, b)
    assert fresh.waiting_to_freeze(STREAM) == ()
    assert fresh.status(STREAM).generations == (used,)  # adopted from its last life
    assert fresh.next_generation(STREAM) == b.next_generation(STREAM) == used + 1


def test_no_generation_is_left_above_the_largest() -> None:
    a = cluster("a")["a"]
    a.apply(Freeze(STREAM, INT64_MAX, IntervalSet()))
    with pytest.raises(GenerationsExhaustedError) as info:
        a.next_generation(STREAM)
    assert info.value.reason == "generations_exhausted"


def test_a_node_that_has_not_declared_the_stream_answers_from_the_records() -> None:
    """A spare about to take over ranks asks before it can declare the new map."""
    n = cluster()
    freeze(n["a"], 4)
    spare = NodeCore("s", 1)
    assert spare.next_generation(STREAM) == 0  # it holds nothing of the stream
    sync(n["a"], spare)
    assert spare.next_generation(STREAM) == 5
    lost = NodeCore("t", 1, unsure_of_past=True)
    assert lost.next_generation(STREAM) is None  # it has heard from no one yet


def test_a_late_request_of_a_superseded_launch_freezes_nothing() -> None:
    # A rank of a dead launch asks for generation 0 after this node froze generation 1
    # for the next launch: freezing 0 now could copy epochs of b's set of 0, which b
    # stops protecting once 1 resolves there, while our record is still on its way.
    n = cluster()
    a, b = n["a"], n["b"]
    for node in n.values():
        commit(node, 1, 2)
    sync(a, b)
    freeze(b, 0)
    sync(a, b)
    freeze(a, 1)
    with pytest.raises(GenerationClosedError, match="froze generation 1") as info:
        a.freeze_fact(STREAM, 0)
    assert info.value.reason == "generation_closed"
    assert a.status(STREAM).generations == (1,)
    freeze(b, 1)
    sync(a, b)
    assert a.generation(STREAM, 1).restore_point == 2
