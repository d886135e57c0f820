"""Real daemons: a spare, a node that has not declared the stream, takes part in a
relaunch with a new member map (PROTOCOL.md 8.1, 14.5), over loopback TCP and real
Unix sockets.

A spare asks ``next_generation`` before it can declare the new map: it answers from
the records of the stream it holds, once it has heard from the peers it links to (it
started without a log, so it might have a past it does not remember). What it waits
for is in its configuration, so an operator who removes a dead host from it and
reloads (SIGHUP) stops the wait; a peer that comes up without sending anything new
still ends it. A declaration whose membership an earlier freeze superseded is refused
and counted.
"""

from __future__ import annotations

import re
import signal
import threading
import urllib.request
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.client import ApiError, Client

STREAM = "job"


def spec(members: dict[str, list[int]], membership: int = 0) -> dict[str, Any]:
    return {"name": STREAM, "members": members, "retention": 0, "shared": ["s3"],
            "policy": {"mode": "any", "domains": ["nvme", "s3"]},
            "membership": membership}  # fmt: skip


def without(config: str, node: str) -> str:
    """A node's configuration without ``node`` in its peers and trust list."""
    config = re.sub(rf'\[\[peers\]\]\nid = "{node}"\naddress = "[^"]*"\n\n?', "", config)
    return re.sub(rf'^"{node}" = "[0-9a-f]+"\n', "", config, flags=re.M)


def reload(cluster: LocalCluster, i: int, config: str) -> None:
    """Rewrite node ``i``'s configuration and reload it (SIGHUP)."""
    seen = cluster.log(i).count("configuration reloaded")
    cluster.configs[i - 1].write_text(config)
    cluster.procs[i].send_signal(signal.SIGHUP)
    until(lambda: cluster.log(i).count("configuration reloaded") > seen, what="reload")


def linked(c: Client, peer: str) -> bool:
    return any(p["id"] == peer and p["connected"] for p in c.status()["peers"])


def in_background(c: Client) -> tuple[threading.Thread, dict[str, Any]]:
    """``next_generation`` asked in a thread; its reply (or error) lands in the dict."""
    out: dict[str, Any] = {}

    def ask() -> None:
        try:
            out["reply"] = c.next_generation(STREAM, timeout=20)
        except ApiError as exc:
            out["error"] = exc

    t = threading.Thread(target=ask)
    t.start()
    return t, out


def test_a_spare_gets_the_next_generation_of_a_stream_it_has_not_declared() -> None:
    with LocalCluster(3) as cluster:
        cluster.start_all()
        c = {i: cluster.client(i) for i in (1, 2, 3)}
        for i in (1, 2):
            c[i].declare(spec({"node-1": [0], "node-2": [1]}))
            c[i].commit(STREAM, i - 1, "s3", 1)
        until(lambda: c[1].state(STREAM)["restore_point"] == 1, what="restore point 1")
        first = c[1].next_generation(STREAM)["generation"]
        other = threading.Thread(target=c[2].restore_point, args=(STREAM, first, 20))
        other.start()
        assert c[1].restore_point(STREAM, first, timeout=20)["restore_point"] == 1
        other.join(30)
        # node-3 holds node-1's and node-2's records: it answers above the generation
        # they froze, and declares nothing by asking.
        until(lambda: c[3].next_generation(STREAM, timeout=20)["generation"] > first,
              what="node-3 hears of the frozen generation")  # fmt: skip
        assert c[3].next_generation(STREAM)["generation"] == first + 1
        assert c[3].streams() == []
        # A stream nobody declared has no generation yet: the first is 0.
        assert c[3].next_generation("nobody-declared-this")["generation"] == 0
        with pytest.raises(ApiError) as info:  # state still needs a declared stream
            c[3].state(STREAM)
        assert info.value.reason == "unknown_stream"


def test_a_spare_answers_once_a_peer_that_brings_nothing_new_links() -> None:
    with LocalCluster(3) as cluster:
        full = cluster.configs[1].read_text()
        cluster.configs[1].write_text(without(full, "node-3"))  # node-2 refuses node-3
        cluster.start_all()
        c = {i: cluster.client(i) for i in (1, 2, 3)}
        for i in (1, 2):
            c[i].declare(spec({"node-1": [0], "node-2": [1]}))
        until(lambda: linked(c[3], "node-1"), what="node-3 linked to node-1")
        with pytest.raises(ApiError) as info:
            c[3].next_generation(STREAM, timeout=0.5)
        assert info.value.reason == "timeout" and "node-2" in str(info.value)
        thread, out = in_background(c[3])
        # node-2 trusts node-3 now; the link brings node-3 no record it lacks (node-1
        # relayed node-2's), only node-2's HELLO: that alone must end the wait.
        reload(cluster, 2, full)
        thread.join(30)
        assert out.get("reply") == {"stream": STREAM, "generation": 1}, out


def test_a_spare_stops_waiting_for_a_dead_host_once_a_reload_removes_it() -> None:
    with LocalCluster(4) as cluster:
        for i in (1, 2, 3):
            cluster.start(i, wait=False)
        for i in (1, 2, 3):
            cluster.wait_ready(i)
        c = {i: cluster.client(i) for i in (1, 2, 3)}
        members = {"node-1": [0], "node-2": [1], "node-3": [2]}
        for x in c.values():
            x.declare(spec(members))
        until(lambda: all(x.state(STREAM)["missing"] == [] for x in c.values()),
              what="every member heard from the others")  # fmt: skip
        cluster.kill(3)  # dead for good; the spare's configuration still names it
        cluster.start(4)
        c[4] = cluster.client(4)
        until(lambda: linked(c[4], "node-1") and linked(c[4], "node-2"), what="spare linked")
        with pytest.raises(ApiError) as info:
            c[4].next_generation(STREAM, timeout=0.5)
        assert info.value.reason == "timeout" and "node-3" in str(info.value)
        assert c[4].status()["counters"]["api_errors_timeout"] == 1
        thread, out = in_background(c[4])
        reload(cluster, 4, without(cluster.configs[3].read_text(), "node-3"))
        thread.join(30)
        assert out.get("reply") == {"stream": STREAM, "generation": 1}, out


def test_a_declaration_of_a_membership_a_freeze_superseded_is_refused_and_counted() -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        c = cluster.client(1)
        c.declare(spec({"node-1": [0]}))
        c.commit(STREAM, 0, "s3", 1)
        g = c.next_generation(STREAM)["generation"]
        assert c.restore_point(STREAM, g, timeout=20)["restore_point"] == 1  # froze g
        with pytest.raises(ApiError) as info:  # a launch older than the one that froze g
            c.declare(spec({"node-1": [0, 1]}, g))
        assert info.value.reason == "membership_superseded"
        assert c.state(STREAM)["spec"]["members"] == {"node-1": [0]}  # nothing changed
        assert c.status()["counters"]["api_errors_membership_superseded"] == 1
        url = f"http://127.0.0.1:{c.status()['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            metrics = resp.read().decode()
        assert 'convergenced_api_errors_total{reason="membership_superseded"} 1.0' in metrics
        assert 'convergenced_membership_changes_total{stream="job"} 0.0' in metrics
