"""Removing a stream: the node forgets it, and the others learn it holds nothing.

Core-level cases, and one with real daemons (the local API, convergencectl, the
metrics labels and a watch of the stream).
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from daemons import LocalCluster, until
from pulled import events

from convergenced.client import ApiError
from convergenced.core.errors import FactError, UnknownStreamError
from convergenced.core.events import RestorePointChanged
from convergenced.core.facts import CloseGenerations, Commit, Declare, HighWater, Undeclare
from convergenced.core.node import NodeCore
from convergenced.core.records import UNDECLARED
from convergenced.core.spec import Policy, StreamSpec
from convergenced.daemon.durability.entries import decode_entry, encode_entry

SPEC = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("nvme"), retention=1)


def sync(a: NodeCore, b: NodeCore) -> None:
    for _ in range(5):
        a.receive(list(b.view), via="b")
        b.receive(list(a.view), via="a")


def agreed_pair() -> tuple[NodeCore, NodeCore]:
    a, b = NodeCore("a", 1), NodeCore("b", 1)
    for rank, n in enumerate((a, b)):
        n.apply(Declare(SPEC))
        for e in (1, 2, 3):
            n.apply(Commit("job", rank, "nvme", e))
    sync(a, b)
    assert a.restore_point("job") == b.restore_point("job") == 3
    return a, b


def test_the_others_see_a_member_that_holds_nothing_and_roll_back() -> None:
    a, b = agreed_pair()
    a.apply(Undeclare("job"))
    assert a.streams() == []
    tomb = a.view.get(("job", "a"))
    assert tomb is not None and tomb.spec_digest == UNDECLARED and not tomb.recoverable
    events(b)
    sync(a, b)
    st = b.status("job")
    assert st.restore_point is None and st.convergence is not None and not st.convergence
    assert RestorePointChanged("job", 3, None, True) in events(b)  # a rollback: a's data may go
    assert st.conflicts == ()
    assert st.why_no_restore_point == "undeclared by a: it holds nothing of the stream any more"
    assert not b.safe_to_delete("job")


def test_once_undeclared_everywhere_the_name_can_be_declared_again_with_any_spec() -> None:
    a, b = agreed_pair()
    a.apply(Undeclare("job"))
    b.apply(Undeclare("job"))
    sync(a, b)
    other = StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("ram"))
    a.apply(Declare(other))
    b.apply(Declare(other))
    for rank, n in enumerate((a, b)):
        n.apply(Commit("job", rank, "ram", 7))
    sync(a, b)
    assert a.restore_point("job") == b.restore_point("job") == 7


def test_a_tombstone_does_not_block_a_declaration_elsewhere() -> None:
    a, _ = agreed_pair()
    a.apply(Undeclare("job"))
    c = NodeCore("b", 1)  # b's disk was replaced meanwhile: it only hears a's tombstone
    tomb = a.view.get(("job", "a"))
    assert tomb is not None
    c.receive([tomb], via="a")
    c.apply(Declare(StreamSpec.create("job", {"a": [0], "b": [1]}, Policy.all_of("ram"))))
    assert c.streams() == ["job"]


def test_replay_and_compaction_forget_an_undeclared_stream() -> None:
    log = [Declare(SPEC), Commit("job", 0, "nvme", 1), Undeclare("job"), Undeclare("job")]
    n = NodeCore("a", 2)
    n.replay(log)
    assert n.streams() == []
    assert n.compacted_facts() == []
    assert decode_entry(encode_entry(Undeclare("job"))) == Undeclare("job")


def test_undeclaring_what_is_not_declared_or_before_knowing_the_past_is_refused() -> None:
    n = NodeCore("a", 1)
    with pytest.raises(UnknownStreamError):
        n.apply(Undeclare("job"))
    unsure = NodeCore("a", 1, unsure_of_past=True)
    unsure.apply(Declare(SPEC))
    with pytest.raises(FactError) as info:
        unsure.apply(Undeclare("job"))
    assert info.value.reason == "unsure_of_past"
    assert unsure.streams() == ["job"]


def _metrics(cluster: LocalCluster, i: int) -> str:
    url = f"http://127.0.0.1:{cluster.metrics_base_port + i - 1}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        return str(r.read().decode())


def test_real_daemons_undeclare_through_convergencectl() -> None:
    with LocalCluster(2) as cluster:
        cluster.start_all()
        clients = [cluster.client(i) for i in (1, 2)]
        for c in clients:
            c.declare(cluster.spec())
        for rank, c in enumerate(clients):
            c.commit("job", rank, "nvme", 1)
        until(lambda: clients[1].state("job")["restore_point"] == 1, what="restore point 1")
        assert 'stream="job"' in _metrics(cluster, 1)
        ctl = [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(1))]
        cmds = (["wait", "job", "99"], ["watch", "job"], ["restore-point", "job", "5"])
        waiting = [
            subprocess.Popen(
                [*ctl, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for cmd in cmds
        ]
        until(lambda: clients[0].status()["clients"] >= 4, what="the waits are under way")
        assert waiting[1].stdout is not None and waiting[1].stdout.readline()  # watching
        out = subprocess.run([*ctl, "undeclare", "job"], capture_output=True, text=True,
                             timeout=30, check=True)  # fmt: skip
        assert out.stdout.strip() == "undeclared job"
        with pytest.raises(ApiError) as info:
            clients[0].state("job")
        assert info.value.reason == "unknown_stream"
        for proc in waiting:  # the waits on the stream end, with the reason
            _, err = proc.communicate(timeout=30)
            assert proc.returncode != 0 and "unknown_stream" in err, err
        assert 'stream="job"' not in _metrics(cluster, 1)  # labels stay bounded
        until(lambda: clients[1].state("job")["why_no_restore_point"] is not None,
              what="node 2 sees the tombstone")  # fmt: skip
        assert "undeclared by node-1" in clients[1].state("job")["why_no_restore_point"]
        again = subprocess.run([*ctl, "undeclare", "job"], capture_output=True, text=True,
                               timeout=30, check=False)  # fmt: skip
        assert again.returncode != 0 and "job" in again.stderr


def _resolve(a: NodeCore, b: NodeCore, generation: int) -> None:
    for n in (a, b):
        fact = n.freeze_fact("job", generation)
        assert fact is not None
        n.apply(fact)
    sync(a, b)
    assert a.generation("job", generation).resolved and b.generation("job", generation).resolved


def test_a_redeclared_stream_keeps_the_old_generations_closed() -> None:
    a, b = agreed_pair()
    _resolve(a, b, 4)
    a.apply(Undeclare("job"))
    assert a.generations_closed_below("job") == 5
    assert a.compacted_facts() == [  # and its high-water mark (test_undeclare_high_water)
        CloseGenerations("job", 5),
        HighWater("job", 3, (("a", 0, 0),), None),
    ]
    after_restart = NodeCore("a", 2)  # from the compacted log
    after_restart.replay(a.compacted_facts())
    for n in (a, after_restart):
        assert n.generations_closed_below("job") == 5
        n.apply(Declare(SPEC))
        with pytest.raises(FactError) as info:
            n.freeze_fact("job", 4)  # the old job's rank asks again: no second frozen set
        assert info.value.reason == "generation_closed"
        assert n.freeze_fact("job", 5) is not None
