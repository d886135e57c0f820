"""Commit input rules against real daemons: what a client sends again after a restart,
and what a node accepts locally never cuts a link.

Real `convergenced run` processes on loopback (`daemons.LocalCluster`), real Unix
sockets, the blocking client.
"""

from __future__ import annotations

import signal
from typing import Any

from daemons import LocalCluster, until

from convergenced.client import Client


def _digest(epoch: int) -> str:
    return f"sha256:{epoch:064x}"


def _commit_all(c: Client, epochs: range) -> list[dict[str, Any]]:
    pending = [c.commit_nowait("job", 0, "nvme", e, digest=_digest(e), size=e) for e in epochs]
    return [p.result() for p in pending]


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
