"""The drain gate (`convergenced.core.drain`) against real daemons on loopback.

A 2-node cluster (node-1 hosts rank 0, node-2 rank 1) serves the module; each test
declares its own stream and names it, so tests do not see each other's streams,
except the one that judges every stream, which starts its own cluster.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from daemons import LocalCluster, until
from prometheus_client.parser import text_string_to_metric_families

from convergenced.client import ApiError, Client
from convergenced.core.drain import CheckpointRequests, drain_target, judge, judge_stream
from convergenced.core.facts import Commit, Declare
from convergenced.core.node import NodeCore
from convergenced.core.spec import Policy, StreamSpec
from convergenced.integrations.drain import SaveRequests

_names = itertools.count(1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2) as c:
        c.start_all()
        yield c


@pytest.fixture
def clients(cluster: LocalCluster) -> tuple[Client, Client]:
    return cluster.client(1), cluster.client(2)


@pytest.fixture
def stream(cluster: LocalCluster, clients: tuple[Client, Client]) -> str:
    name = f"g{next(_names)}"
    for c in clients:
        c.declare(cluster.spec(name))
    return name


def commit_both(clients: tuple[Client, Client], stream: str, *epochs: int) -> None:
    for e in epochs:
        for rank, c in enumerate(clients):
            c.commit(stream, rank, "nvme", e)


def gate(cluster: LocalCluster, node: int, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(node)),
         "gate", f"node-{node}", *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def drain_metrics(cluster: LocalCluster, stream: str) -> dict[str, float]:
    url = f"http://127.0.0.1:{cluster.metrics_base_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        if family.name in ("convergenced_drain_safe", "convergenced_checkpoint_requested")
        for s in family.samples
        if s.labels.get("stream") == stream
    }


def test_a_node_whose_newest_epoch_every_member_published_may_drain(
    cluster: LocalCluster, clients: tuple[Client, Client], stream: str
) -> None:
    commit_both(clients, stream, 1, 2)
    clients[0].wait(stream, 2, timeout=20)
    until(lambda: clients[0].state(stream)["knowledge"] == "published", what="published")
    p = gate(cluster, 1, "--stream", stream, "--timeout", "20", "--json")
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    assert answer["safe"] and answer["node"] == "node-1"
    assert answer["streams"][stream] == {"safe": True, "target": 2, "restore_point": 2,
                                         "knowledge": "published", "reason": ""}  # fmt: skip
    until(lambda: drain_metrics(cluster, stream).get("convergenced_drain_safe") == 1.0,
          what="drain_safe 1")  # fmt: skip


def test_an_epoch_the_other_member_lacks_blocks_the_drain_and_the_gate_fails_closed(
    cluster: LocalCluster, clients: tuple[Client, Client], stream: str
) -> None:
    commit_both(clients, stream, 1)
    clients[0].wait(stream, 1, timeout=20)
    clients[0].commit(stream, 0, "nvme", 2)  # node-2 has not saved epoch 2 yet
    p = gate(cluster, 1, "--stream", stream, "--timeout", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "NOT safe to drain" in p.stdout
    assert "the restore point 1 is older than the drain's target 2" in p.stdout
    assert drain_metrics(cluster, stream)["convergenced_drain_safe"] == 0.0
    # Once node-2 saves it and both publish it, the same gate passes.
    clients[1].commit(stream, 1, "nvme", 2)
    p = gate(cluster, 1, "--stream", stream, "--timeout", "20")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "node-1: safe to drain" in p.stdout
    counters = clients[0].status()["counters"]
    assert counters["drain_requests_timeout"] >= 1 and counters["drain_requests_safe"] >= 1


def test_a_checkpoint_request_reaches_the_watchers_and_the_gate_waits_for_it(
    cluster: LocalCluster, clients: tuple[Client, Client], stream: str
) -> None:
    commit_both(clients, stream, 1)
    clients[0].wait(stream, 1, timeout=20)
    until(lambda: clients[0].state(stream)["knowledge"] == "published", what="published")
    result: dict[str, Any] = {}

    def drain() -> None:
        with Client(cluster.socket_path(1)) as c:
            result.update(c.drain("node-1", streams=[stream], checkpoint=True, timeout=30))

    requests = SaveRequests(cluster.socket_path(1), stream)
    assert requests.pending() is None
    thread = threading.Thread(target=drain)
    thread.start()
    # The job's side: its training loop sees the request and saves epoch 2 on both nodes.
    until(lambda: requests.pending() == 1, what="the checkpoint request")
    assert drain_metrics(cluster, stream)["convergenced_checkpoint_requested"] == 1.0
    assert not result  # epoch 1 alone no longer satisfies this drain
    commit_both(clients, stream, 2)
    thread.join(timeout=30)
    assert result["safe"] and result["streams"][stream]["target"] == 2
    assert result["streams"][stream]["restore_point"] == 2
    assert clients[0].state(stream)["checkpoint_requested"] is None  # withdrawn
    until(lambda: requests.pending() is None, what="the request withdrawn")
    requests.close()
    assert drain_metrics(cluster, stream)["convergenced_checkpoint_requested"] == 0.0


def test_the_gate_answers_only_for_its_own_node_and_known_streams(
    cluster: LocalCluster, clients: tuple[Client, Client]
) -> None:
    with pytest.raises(ApiError) as info:
        clients[0].drain("node-2", timeout=1)
    assert info.value.reason == "wrong_node"
    p = subprocess.run(
        [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(1)),
         "gate", "node-2", "--timeout", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 1 and "wrong_node" in p.stderr and "ask the daemon of node-2" in p.stderr
    with pytest.raises(ApiError) as info:
        clients[0].drain("node-1", streams=["no-such-stream"], timeout=1)
    assert info.value.reason == "unknown_stream"
    with pytest.raises(ApiError) as info:
        clients[0].call("drain", node="node-1", streams="job", timeout=1)
    assert info.value.kind.value == "bad_request"


def test_without_a_stream_filter_every_stream_of_the_node_must_be_safe() -> None:
    with LocalCluster(2) as cluster:
        cluster.start_all()
        clients = (cluster.client(1), cluster.client(2))
        for name in ("a", "b"):
            for c in clients:
                c.declare(cluster.spec(name))
        commit_both(clients, "a", 1)
        # "b" has nothing recoverable yet: a drain would lose the whole job's work.
        answer = clients[0].drain("node-1", timeout=1)
        assert not answer["safe"]
        assert answer["streams"]["a"]["safe"]
        assert not answer["streams"]["b"]["safe"]
        assert answer["streams"]["b"]["reason"].startswith("no restore point")
        commit_both(clients, "b", 5)
        answer = clients[0].drain("node-1", timeout=20)
        assert answer["safe"], answer
        assert sorted(answer["streams"]) == ["a", "b"]


# -- the core's rules, on one node ---------------------------------------------------------


def _solo(*epochs: int) -> Any:
    """The status of a one-member stream on node a, after commits of ``epochs``."""
    node = NodeCore("a", 1)
    node.apply(Declare(StreamSpec.create("job", {"a": [0]}, Policy.all_of("nvme"))))
    for e in epochs:
        node.apply(Commit("job", 0, "nvme", e))
    return node.status("job")


def test_the_target_is_the_newest_epoch_held_or_the_next_for_a_checkpoint() -> None:
    status = _solo(3, 4)
    assert drain_target(status, checkpoint=False) == 4
    assert drain_target(status, checkpoint=True) == 5
    assert drain_target(_solo(), checkpoint=False) == 0
    verdict = judge_stream(status, 4)
    assert (verdict.safe, verdict.restore_point, verdict.reason) == (True, 4, "")
    verdict = judge_stream(status, 5)
    assert not verdict.safe and "older than the drain's target 5" in verdict.reason
    verdict = judge_stream(_solo(), 0)
    assert not verdict.safe and verdict.reason.startswith("no restore point")
    assert not judge("a", [status, _solo()], {"job": 4}).safe


def test_checkpoint_requests_show_the_newest_asked_until_a_newer_epoch_is_held() -> None:
    requests = CheckpointRequests()
    assert requests.pending(_solo(4)) is None
    requests.ask("job", 4)
    requests.ask("job", 2)
    assert requests.pending(_solo(4)) == 4
    assert requests.pending(_solo(4, 5)) is None  # saved: no more asking
    requests.withdraw("job", 4)
    assert requests.pending(_solo(1)) == 2
    assert requests.pending(_solo(3)) is None
    requests.withdraw("job", 2)
    requests.withdraw("job", 2)  # twice: harmless
    assert requests.pending(_solo(1)) is None
