"""`state` says why there is no restore point, in the terms users look at."""

from __future__ import annotations

from convergenced.core.facts import Commit, Declare, Retract
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec


def pair(retention: int) -> tuple[NodeCore, NodeCore]:
    spec = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("nvme"), retention)
    a, b = NodeCore("a", 1), NodeCore("b", 1)
    a.apply(Declare(spec))
    b.apply(Declare(spec))
    return a, b


def sync(a: NodeCore, b: NodeCore) -> None:
    for _ in range(5):
        a.receive(list(b.view), via="b")
        b.receive(list(a.view), via="a")


def test_a_member_not_heard_from() -> None:
    a, _ = pair(1)
    assert a.status("job").why_no_restore_point == "no record yet from b"


def test_with_a_restore_point_there_is_nothing_to_explain() -> None:
    a, b = pair(1)
    for rank, n in enumerate((a, b)):
        n.apply(Commit("job", rank, "nvme", 1))
    sync(a, b)
    assert a.status("job").restore_point == 1
    assert a.status("job").why_no_restore_point is None


def test_retention_0_and_a_retraction_say_why_the_older_epoch_is_not_used() -> None:
    """Both members hold 1 and 2; 2 is retracted: 1 is below the rollback floor 2."""
    a, b = pair(0)
    for rank, n in enumerate((a, b)):
        n.apply(Commit("job", rank, "nvme", 1))
        n.apply(Commit("job", rank, "nvme", 2))
    sync(a, b)
    assert a.restore_point("job") == 2
    a.apply(Retract("job", 0, "nvme", 2))
    sync(a, b)
    st = a.status("job")
    assert st.restore_point is None
    why = st.why_no_restore_point
    assert why is not None
    assert "newest epoch every member holds, 1, is below the rollback floor 2" in why
    assert "retention of 1 or more" in why


def test_an_empty_convergence_interval() -> None:
    a, b = pair(1)
    a.apply(Commit("job", 0, "nvme", 1))
    b.apply(Commit("job", 1, "nvme", 2))
    sync(a, b)
    assert "no epoch is recoverable on every member" in (a.status("job").why_no_restore_point or "")


def test_a_node_without_its_log_waits_for_its_peers() -> None:
    spec = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("nvme"))
    a = NodeCore("a", 1, unsure_of_past=True)
    a.apply(Declare(spec))
    assert "waits to hear from b" in (a.status("job").why_no_restore_point or "")
