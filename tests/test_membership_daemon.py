"""Real daemons: a job's member map changes (a spare replaces a dead host, the job
shrinks or grows, a node loses its disk), over loopback TCP and real Unix sockets.

Each test runs the flow of PROTOCOL.md 8.1 with the client library, as a relaunch's
integration would: one rank asks ``next_generation``, every rank of the new launch
declares the new map with ``membership`` set to that number, a rank that moved
commits on its new node the shared-tier epochs it verified (adoption), and every
rank asks the restore point of the generation. The stream keeps its checkpoints in a
node-local ``nvme`` tier and a shared ``s3`` tier that lags one epoch behind.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Mapping
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.client import ApiError, Client
from convergenced.ctl import main

STREAM = "job"
POLICY = {"mode": "any", "domains": ["nvme", "s3"]}


def spec(members: Mapping[str, list[int]], membership: int = 0) -> dict[str, Any]:
    """The stream's spec for this member map: any of [nvme, s3], s3 shared."""
    return {"name": STREAM, "members": dict(members), "policy": POLICY, "retention": 0,
            "shared": ["s3"], "membership": membership}  # fmt: skip


def train(clients: Mapping[int, Client], ranks: Mapping[int, list[int]], epochs: range) -> None:
    """Each node's ranks save ``epochs`` to nvme, and to s3 all but the last (the
    upload lags one epoch)."""
    last = epochs[-1]
    for e in epochs:
        for i, c in clients.items():
            for rank in ranks[i]:
                c.commit(STREAM, rank, "nvme", e)
                if e < last:
                    c.commit(STREAM, rank, "s3", e)


def restore_points(
    clients: Mapping[int, Client], generation: int, *, first: int | None = None
) -> dict[int, Any]:
    """Every client asks the restore point of ``generation`` at once (as the ranks of
    a launch do), or node ``first`` before the others (once it froze); the answers
    by node."""
    out: dict[int, Any] = {}

    def ask(i: int, c: Client) -> None:
        try:
            out[i] = c.restore_point(STREAM, generation, timeout=20)
        except ApiError as exc:
            out[i] = exc

    threads = {i: threading.Thread(target=ask, args=(i, c)) for i, c in clients.items()}
    if first is not None:
        threads[first].start()
        until(lambda: generation in clients[first].state(STREAM)["generations"], what="froze")
    for i, t in threads.items():
        if i != first:
            t.start()
    for t in threads.values():
        t.join(30)
    return out


def at(clients: Mapping[int, Client], epoch: int) -> bool:
    return all(c.state(STREAM)["restore_point"] == epoch for c in clients.values())


def three_declared(cluster: LocalCluster) -> dict[int, Client]:
    """Nodes 1-3 started (node-4, if configured, not yet), the three-node spec declared
    on each; their clients."""
    for i in (1, 2, 3):
        cluster.start(i, wait=False)
    for i in (1, 2, 3):
        cluster.wait_ready(i)
    c = {i: cluster.client(i) for i in (1, 2, 3)}
    for x in c.values():
        x.declare(spec(THREE))
    return c


def without(config: str, node: str) -> str:
    """A node's configuration without ``node`` in its peers and trust list."""
    config = re.sub(rf'\[\[peers\]\]\nid = "{node}"\naddress = "[^"]*"\n\n?', "", config)
    return re.sub(rf'^"{node}" = "[0-9a-f]+"\n', "", config, flags=re.M)


def linked(c: Client, *peers: str) -> bool:
    up = {p["id"] for p in c.status()["peers"] if p["connected"]}
    return set(peers) <= up


THREE = {"node-1": [0], "node-2": [1], "node-3": [2]}


def test_a_spare_added_by_a_reload_replaces_a_dead_host_from_the_shared_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with LocalCluster(4) as cluster:
        full = [cfg.read_text() for cfg in cluster.configs]
        for i in (1, 2, 3):  # the cluster before the spare was provisioned
            cluster.configs[i - 1].write_text(without(full[i - 1], "node-4"))
        c = three_declared(cluster)
        train(c, {1: [0], 2: [1], 3: [2]}, range(1, 4))
        until(lambda: at(c, 3), what="restore point 3 everywhere")

        cluster.kill(3)  # node-3 is gone for good, with its nvme copies
        del c[3]
        new_map = {"node-1": [0], "node-2": [1], "node-4": [2]}
        with pytest.raises(ApiError) as info:  # nobody here knows node-4 yet
            c[1].declare(spec(new_map, 99))
        assert info.value.reason == "unknown_member"
        # The operator provisions node-4 (without the dead host) and reloads the others.
        cluster.configs[3].write_text(without(full[3], "node-3"))
        cluster.start(4)
        for i in (1, 2):
            cluster.configs[i - 1].write_text(full[i - 1])
            cluster.procs[i].send_signal(signal.SIGHUP)
        c[4] = cluster.client(4)
        until(lambda: linked(c[4], "node-1", "node-2"), what="the spare linked")

        g = c[4].next_generation(STREAM, timeout=20)["generation"]  # not declared on node-4
        assert g == c[1].next_generation(STREAM)["generation"] == 1
        for x in c.values():
            x.declare(spec(new_map, g))
        for e in (1, 2):  # rank 2's shards found in s3, verified, committed on node-4
            c[4].commit(STREAM, 2, "s3", e)
        answers = restore_points(c, g)
        assert {i: a["restore_point"] for i, a in answers.items()} == {1: 2, 2: 2, 4: 2}
        # The new world trains on and agrees on its next epoch.
        train(c, {1: [0], 2: [1], 4: [2]}, range(3, 5))
        until(lambda: at(c, 4), what="restore point 4 in the new world")
        st = c[1].state(STREAM)
        assert st["membership"] == g and st["spec"]["members"] == new_map
        assert st["missing"] == [] and st["conflicts"] == []
        assert c[1].status()["counters"]["membership_changes"] == 1
        log = cluster.log(1)
        assert '"event": "membership changed"' in log and '"replaced": ["node-3 -> node-4"]' in log
        # What the operator sees on node-1.
        assert main(["--socket", str(cluster.socket_path(1)), "state", STREAM]) == 0
        lines = capsys.readouterr().out.splitlines()
        for expected in (
            f"membership      {g} (this member map applies from generation {g} on)",
            "members         node-1: 0, node-2: 1, node-4: 2",
            "scopes          shared s3; node-local nvme",
        ):
            assert expected in lines, f"{expected!r} not in {lines}"


def test_a_job_shrinks_to_three_nodes_and_one_hosts_two_ranks() -> None:
    with LocalCluster(4) as cluster:
        cluster.start_all()
        c = {i: cluster.client(i) for i in (1, 2, 3, 4)}
        four = {f"node-{i}": [i - 1] for i in (1, 2, 3, 4)}
        for x in c.values():
            x.declare(spec(four))
        train(c, {i: [i - 1] for i in c}, range(1, 4))
        until(lambda: at(c, 3), what="restore point 3 everywhere")

        cluster.kill(4)
        del c[4]
        g = c[1].next_generation(STREAM, timeout=20)["generation"]
        three = {"node-1": [0, 3], "node-2": [1], "node-3": [2]}
        for x in c.values():
            x.declare(spec(three, g))
        for e in (1, 2):  # node-1 adopts rank 3's shared-tier shards
            c[1].commit(STREAM, 3, "s3", e)
        answers = restore_points(c, g)
        assert {i: a["restore_point"] for i, a in answers.items()} == {1: 2, 2: 2, 3: 2}
        assert c[1].state(STREAM)["newest"]["node-1"] == {"s3": 2}  # rank 3 lacks nvme


def test_a_job_grows_to_four_nodes_with_a_rank_that_reads_the_shared_tier() -> None:
    with LocalCluster(4) as cluster:
        c = three_declared(cluster)
        train(c, {1: [0], 2: [1], 3: [2]}, range(1, 4))
        until(lambda: at(c, 3), what="restore point 3 everywhere")

        cluster.start(4)
        c[4] = cluster.client(4)
        until(lambda: linked(c[4], "node-1", "node-2", "node-3"), what="node-4 linked")
        g = c[2].next_generation(STREAM, timeout=20)["generation"]
        four = {**THREE, "node-4": [3]}
        for x in c.values():
            x.declare(spec(four, g))
        # Rank 3 of the larger world loads the checkpoints the world of three saved
        # (resharding) and commits those it verified complete for that world.
        for e in (1, 2):
            c[4].commit(STREAM, 3, "s3", e)
        answers = restore_points(c, g)
        assert {a["restore_point"] for a in answers.values()} == {2}, answers
        assert len(answers) == 4
        for i in (1, 2, 3):  # the ranks that stayed keep their node-local epochs
            assert c[i].state(STREAM)["recoverable"] == [[1, 3]]


def lost_disk(cluster: LocalCluster) -> tuple[dict[int, Client], int]:
    """Three nodes trained to epoch 3 (s3 to 2); node-3 loses its disk (its state
    directory and its nvme tier) and restarts; its rank commits again what it finds,
    the shared tier's epochs. Returns the clients and the next generation."""
    cluster.start_all()
    c = {i: cluster.client(i) for i in (1, 2, 3)}
    for x in c.values():
        x.declare(spec(THREE))
    train(c, {1: [0], 2: [1], 3: [2]}, range(1, 4))
    until(lambda: at(c, 3), what="restore point 3 everywhere")
    cluster.kill(3)
    for f in (cluster.dir / "node-3" / "state").iterdir():
        f.unlink()
    cluster.start(3)
    c[3] = cluster.client(3)
    c[3].declare(spec(THREE))
    for e in (1, 2):
        c[3].commit(STREAM, 2, "s3", e)
    return c, c[3].next_generation(STREAM, timeout=20)["generation"]


def test_a_node_that_lost_its_disk_restores_from_the_shared_tier() -> None:
    with LocalCluster(3) as cluster:
        c, g = lost_disk(cluster)
        # node-3 freezes last, once it holds the others' frozen sets (its next
        # generation is then above g): it copies their epochs it can read. When it
        # freezes first it may not (the test below), so the order is made certain.
        answers: dict[int, Any] = {}
        late = threading.Thread(target=lambda: answers.update(restore_points(
            {i: c[i] for i in (1, 2)}, g, first=1)))  # fmt: skip
        late.start()
        until(lambda: c[3].next_generation(STREAM, timeout=20)["generation"] > g,
              what="node-3 holds the others' frozen sets")  # fmt: skip
        answers.update(restore_points({3: c[3]}, g))
        late.join(30)
        assert {i: a["restore_point"] for i, a in answers.items()} == {1: 2, 2: 2, 3: 2}
        assert c[3].status()["counters"]["state_losses"] == 1


def test_a_node_that_lost_its_disk_and_freezes_first_agrees_with_the_others() -> None:
    """A node that lost its state freezes from its adopted high-water mark minus the
    retention (3), above every epoch it can read (1-2 in s3), when that mark reached it
    before it froze: the generation then resolves to None on every member (a known
    limit, PROTOCOL.md 13.9). When the mark came later it freezes 1-2 and the answer is
    2. Which one depends on the order its peers' records arrive; either way every
    member gives the same answer (S2)."""
    with LocalCluster(3) as cluster:
        c, g = lost_disk(cluster)
        answers = restore_points(c, g, first=3)
        points = {i: a["restore_point"] for i, a in answers.items()}
        assert points in ({1: 2, 2: 2, 3: 2}, {1: None, 2: None, 3: None}), points


def test_two_launches_that_declare_different_maps_for_one_generation_are_refused() -> None:
    with LocalCluster(4) as cluster:
        cluster.start_all()
        c = {i: cluster.client(i) for i in (1, 2, 3, 4)}
        old = {i: c[i] for i in (1, 2, 3)}
        for x in old.values():
            x.declare(spec(THREE))
        train(old, {1: [0], 2: [1], 3: [2]}, range(1, 3))
        until(lambda: at(old, 2), what="restore point 2")
        g = c[1].next_generation(STREAM, timeout=20)["generation"]
        # One launch replaced node-3 by node-4; another, with the same generation,
        # kept node-3.
        a = spec({"node-1": [0], "node-2": [1], "node-4": [2]}, g)
        b = spec(THREE, g)
        for i in (1, 2, 4):
            c[i].declare(a)
        # node-3 still holds the old map and sees its members move on (missing for it,
        # not in conflict).
        until(lambda: "node-1" in c[3].state(STREAM)["moved_on"], what="node-3 sees node-1")
        assert c[3].state(STREAM)["conflicts"] == []
        refused = []
        for i in (1, 2, 3):
            with pytest.raises(ApiError) as info:
                c[i].declare(b)
            refused.append((i, info.value.reason))
        assert refused == [(1, "spec_conflict"), (2, "spec_conflict"), (3, "spec_conflict")]
        assert "for membership" in str(info.value)  # node-3 knows of it from the records
        st = c[3].state(STREAM)
        assert st["membership"] == 0 and st["spec"]["members"] == THREE  # nothing changed
        assert c[1].state(STREAM)["spec"]["members"] == a["members"]
        for i in (1, 2, 3):
            assert c[i].status()["counters"]["api_errors_spec_conflict"] == 1
        # The older launch's map, declared again after a newer one, is superseded.
        with pytest.raises(ApiError) as info:
            c[1].declare(spec(THREE))
        assert info.value.reason == "membership_superseded"
        assert c[1].status()["counters"]["api_errors_membership_superseded"] == 1


def test_no_survivor_may_delete_the_newest_shared_epoch_of_a_dead_member() -> None:
    with LocalCluster(4) as cluster:
        c = three_declared(cluster)
        for e in range(1, 6):  # node-3's uploads lag: its s3 tier stops at epoch 3
            for i, x in c.items():
                x.commit(STREAM, i - 1, "nvme", e)
                if i != 3 or e <= 3:
                    x.commit(STREAM, i - 1, "s3", e)
        until(lambda: at(c, 5), what="restore point 5 everywhere")
        until(lambda: c[1].state(STREAM)["safe_to_delete"] == [[1, 2]], what="GC horizon")

        cluster.kill(3)  # its rank can only be restored from s3 now: epoch 3
        del c[3]
        train(c, {1: [0], 2: [1]}, range(6, 9))  # the survivors keep saving
        for i in (1, 2):
            assert c[i].state(STREAM)["safe_to_delete"] == [[1, 2]]
            with pytest.raises(ApiError) as info:
                c[i].retire(STREAM, i - 1, "s3", 3)
            assert info.value.reason == "not_safe_to_delete"
            for e in (1, 2):  # what was safe goes
                c[i].retire(STREAM, i - 1, "s3", e)
                c[i].retire(STREAM, i - 1, "nvme", e)
        # The spare takes rank 2 over: epoch 3 is still in every member's s3 tier.
        cluster.start(4)
        c[4] = cluster.client(4)
        until(lambda: linked(c[4], "node-1", "node-2"), what="node-4 linked")
        g = c[1].next_generation(STREAM, timeout=20)["generation"]
        for x in c.values():
            x.declare(spec({"node-1": [0], "node-2": [1], "node-4": [2]}, g))
        for e in (1, 2, 3):  # rank 2's shards in s3 (1 and 2 were rank 2's own to delete)
            c[4].commit(STREAM, 2, "s3", e)
        answers = restore_points(c, g)
        assert {i: a["restore_point"] for i, a in answers.items()} == {1: 3, 2: 3, 4: 3}
