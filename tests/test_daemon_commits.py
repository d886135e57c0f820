"""Commit input rules against real daemons: what a client sends again after a restart,
and what a node accepts locally never cuts a link.

Real `convergenced run` processes on loopback (`daemons.LocalCluster`), real Unix
sockets, the blocking client.
"""

from __future__ import annotations

import signal
import urllib.request
from typing import Any

import pytest
from daemons import LocalCluster, until

from convergenced.client import Client
from convergenced.core.local_api_codec import ApiError


def _digest(epoch: int) -> str:
    return f"sha256:{epoch:064x}"


def _commit_all(c: Client, epochs: range) -> list[dict[str, Any]]:
    # At most 100 in flight: a client with more than limits.client_queue (256) replies
    # unread is disconnected, which a loaded machine can make this test's reader be.
    out: list[dict[str, Any]] = []
    for lo in range(0, len(epochs), 100):
        batch = epochs[lo : lo + 100]
        pending = [c.commit_nowait("job", 0, "nvme", e, digest=_digest(e), size=e) for e in batch]
        out += [p.result() for p in pending]
    return out


def test_commits_sent_again_after_kill_9_and_compaction_are_acknowledged_once() -> None:
    with LocalCluster(1, extra="wal_compact_bytes = 65536") as cluster:
        cluster.start_all()
        c = cluster.client(1)
        cluster.declare_solo(c, "job", "nvme")
        epochs = range(1, 801)  # about 80 KiB of commits: the log is compacted
        _commit_all(c, epochs)
        again = c.commit("job", 0, "nvme", 5, digest=_digest(5), size=5)
        assert again == {"stream": "job", "epoch": 5, "durable": True}
        counters = c.status()["counters"]
        assert counters["facts_commit"] == 800
        assert counters["repeated_commit"] == 1
        until(lambda: c.status()["counters"].get("wal_compactions", 0) >= 1, what="compaction")
        before = c.state("job")
        cluster.kill(1, signal.SIGKILL)

        cluster.start(1)
        c = cluster.client(1)
        wal = cluster.dir / "node-1" / "state" / "facts.wal"
        size = wal.stat().st_size
        replies = _commit_all(c, epochs)  # a client re-sending what it had no answer for
        assert replies == [{"stream": "job", "epoch": e, "durable": True} for e in epochs]
        counters = c.status()["counters"]
        assert counters["repeated_commit"] == 800
        assert "facts_commit" not in counters
        assert wal.stat().st_size == size  # nothing logged again
        after = c.state("job")
        for key in ("recoverable", "restore_point", "high_water", "newest"):
            assert after[key] == before[key], key
        # The digests survived compaction and the restart: another one is a conflict.
        for digest, reason in ((_digest(6), "digest_conflict"), ("d", "bad_digest")):
            with pytest.raises(ApiError) as info:
                c.commit("job", 0, "nvme", 5, digest=digest, size=5)
            assert info.value.reason == reason
        assert wal.stat().st_size == size


def test_commits_in_65_domains_never_cut_a_link() -> None:
    # A record of more than MAX_DOMAINS (64) newest entries is refused by every peer,
    # which closes the link on it: a commit to a domain the policy does not name is
    # refused instead, so the node's record names the policy's domains only.
    with LocalCluster(2) as cluster:
        cluster.start_all()
        c1, c2 = cluster.client(1), cluster.client(2)
        for c in (c1, c2):
            c.declare(cluster.spec())
        for d in [f"tier{i}" for i in range(65)]:
            with pytest.raises(ApiError) as info:
                c1.commit("job", 0, d, 1)
            assert info.value.reason == "unknown_domain"
        c1.commit("job", 0, "nvme", 1)
        c2.commit("job", 1, "nvme", 1)
        until(lambda: c2.state("job")["restore_point"] == 1, what="restore point on node-2")
        until(lambda: c1.state("job")["restore_point"] == 1, what="restore point on node-1")
        assert set(c2.state("job")["newest"]["node-1"]) == {"nvme"}
        for c in (c1, c2):
            counters = c.status()["counters"]
            assert not [k for k in counters if k.startswith(("peer_rejected", "records_rejected"))]
            assert "peer_reconnects" not in counters
        assert c1.status()["counters"]["api_errors_unknown_domain"] == 65
        url = f"http://127.0.0.1:{c1.status()['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            metrics = resp.read().decode()
        assert "tier" not in metrics  # labels stay bounded by the declared specs
        assert 'convergenced_commits_total{domain="other",outcome="rejected"} 65.0' in metrics


def test_a_declaration_naming_a_node_outside_the_cluster_is_refused_unless_allowed() -> None:
    with LocalCluster(2) as cluster:
        cluster.start_all()
        c = cluster.client(1, reconnect=20)
        spec = cluster.spec("job") | {"members": {"node-1": [0], "node-2": [1], "nod-3": [2]}}
        with pytest.raises(ApiError) as info:
            c.declare(spec)
        assert info.value.reason == "unknown_member" and "nod-3" in str(info.value)
        assert c.streams() == []
        assert c.declare(spec, allow_unknown_members=True)["stream"] == "job"
        assert c.declare(spec)["stream"] == "job"  # declared: the same spec again
        assert c.status()["counters"]["api_errors_unknown_member"] == 1
        # A daemon that lost its state gets the declaration again, flag and all.
        cluster.kill(1, signal.SIGKILL)
        state = cluster.dir / "node-1" / "state"
        for f in state.iterdir():
            if f.is_file():
                f.unlink()
        cluster.start(1)
        until(lambda: c.streams() == ["job"], what="declared again after the reconnect")
        assert "api_errors_unknown_member" not in c.status()["counters"]


def test_a_reload_that_adds_a_peer_lets_a_declaration_name_it() -> None:
    with LocalCluster(3, insecure=True) as cluster:  # no trust list: the peers alone
        cfg = cluster.configs[0]
        full = cfg.read_text()
        first = full.index("[[peers]]")
        cfg.write_text(full[: full.index("[[peers]]", first + 1)])  # node-1 knows node-2 only
        cluster.start_all()
        c = cluster.client(1)
        spec = cluster.spec("job")
        with pytest.raises(ApiError) as info:
            c.declare(spec)
        assert info.value.reason == "unknown_member" and "node-3" in str(info.value)
        cfg.write_text(full)
        cluster.procs[1].send_signal(signal.SIGHUP)
        until(lambda: "configuration reloaded" in cluster.log(1), what="reload")
        assert c.declare(spec)["stream"] == "job"
