"""Bytes stored per stream and domain, on real daemons: the ``state`` map, ``status``,
the metrics endpoint, ``convergencectl state``, ``status`` and ``top``, and a restart.

A stream of two ranks on node-1 commits epochs with sizes in two domains (nvme and a
shared s3); some are retracted or retired, some commits are refused. What the node's
ranks hold is the sum of the sizes of the epochs committed and neither retracted nor
retired: the same figure in every place, and the same after a kill -9 and a restart
that replays a compacted log.
"""

from __future__ import annotations

import hashlib
import json
import signal
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from daemons import LocalCluster, until
from prometheus_client.parser import text_string_to_metric_families

from convergenced.client import ApiError, Client
from convergenced.ctl import main, render_top
from convergenced.ctl.formatting import format_bytes

JOB = "job"
"""Two ranks on node-1, any of [nvme, s3], s3 shared."""
BULK = "bulk"
"""One rank on node-1, nvme: enough commits with digests to compact the log."""
BULK_EPOCHS = 700
BULK_RETIRED = 400


def digest(*parts: object) -> str:
    return "sha256:" + hashlib.sha256(repr(parts).encode()).hexdigest()


def commit(c: Client, rank: int, domain: str, epoch: int, size: int) -> None:
    """A commit to `JOB` whose digest names its shard."""
    c.commit(JOB, rank, domain, epoch, digest=digest(JOB, rank, domain, epoch), size=size)


def scrape(cluster: LocalCluster) -> dict[tuple[str, str, str], float]:
    """(metric, stream, domain) -> value of the stored_* gauges on node-1's /metrics."""
    url = f"http://127.0.0.1:{cluster.metrics_base_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels["stream"], s.labels["domain"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name in ("convergenced_stored_bytes", "convergenced_stored_epochs")
        for s in family.samples
    }


def fill(cluster: LocalCluster) -> Client:
    """Declare both streams on node-1, commit, refuse, retract and retire."""
    c = cluster.client(1)
    c.declare({"name": JOB, "members": {"node-1": [0, 1]}, "retention": 0, "shared": ["s3"],
               "policy": {"mode": "any", "domains": ["nvme", "s3"]}})  # fmt: skip
    for rank, domain, epoch, size in [
        (0, "nvme", 1, 100), (1, "nvme", 1, 150), (0, "s3", 1, 1000), (1, "s3", 1, 2000),
        (0, "nvme", 2, 120), (1, "nvme", 2, 130),
        (0, "nvme", 3, 0), (1, "nvme", 3, 5), (0, "s3", 3, 500), (1, "s3", 3, 700),
    ]:  # fmt: skip
        commit(c, rank, domain, epoch, size)
    with pytest.raises(ApiError) as info:  # another checkpoint for a held epoch
        c.commit(JOB, 0, "nvme", 2, digest=digest("other"), size=10**9)
    assert info.value.reason == "digest_conflict"
    with pytest.raises(ApiError) as info:
        c.commit(JOB, 0, "hdd", 4, digest=digest("hdd"), size=10**9)
    assert info.value.reason == "unknown_domain"
    c.retract(JOB, 1, "nvme", 2)  # lost: 130 bytes less
    c.wait(JOB, 3, timeout=20)
    # GC keeps each rank's newest epoch in the shared tier (3): 1 and 2 may go.
    until(lambda: {1, 2} <= _epochs(c.state(JOB)["safe_to_delete"]),
          what="epochs 1-2 safe to delete")  # fmt: skip
    c.retire(JOB, 0, "nvme", 1)
    c.retire(JOB, 1, "nvme", 1)  # s3 keeps epoch 1

    cluster.declare_solo(c, BULK, "nvme", retention=0)
    pending = [
        c.commit_nowait(BULK, 0, "nvme", e, digest=digest(BULK, e), size=1000 + e)
        for e in range(1, BULK_EPOCHS + 1)
    ]
    for p in pending:
        p.result(timeout=30)
    c.wait(BULK, BULK_EPOCHS, timeout=20)
    until(lambda: BULK_RETIRED in _epochs(c.state(BULK)["safe_to_delete"]),
          what="bulk epochs safe to delete")  # fmt: skip
    for e in range(1, BULK_RETIRED + 1):
        c.retire(BULK, 0, "nvme", e)
    return c


def _epochs(ranges: list[list[int]]) -> set[int]:
    return {e for lo, hi in ranges for e in range(lo, hi + 1)}


JOB_BYTES = {"nvme": 120 + 0 + 5, "s3": 1000 + 2000 + 500 + 700}
"""rank 0's epoch 2 and both ranks' epoch 3 in nvme; epochs 1 and 3 of both in s3."""
JOB_EPOCHS = {"nvme": 2, "s3": 2}
BULK_BYTES = {"nvme": sum(1000 + e for e in range(BULK_RETIRED + 1, BULK_EPOCHS + 1))}
BULK_COUNT = {"nvme": BULK_EPOCHS - BULK_RETIRED}
EXPECTED_METRICS = {
    **{("convergenced_stored_bytes", JOB, d): float(v) for d, v in JOB_BYTES.items()},
    **{("convergenced_stored_epochs", JOB, d): float(v) for d, v in JOB_EPOCHS.items()},
    ("convergenced_stored_bytes", BULK, "nvme"): float(BULK_BYTES["nvme"]),
    ("convergenced_stored_epochs", BULK, "nvme"): float(BULK_COUNT["nvme"]),
}


@pytest.fixture(scope="module")
def filled() -> Iterator[tuple[LocalCluster, Client]]:
    with LocalCluster(1, extra="wal_compact_bytes = 65536") as cluster:
        cluster.start_all()
        yield cluster, fill(cluster)


def test_state_says_the_bytes_and_epochs_held_per_domain(
    filled: tuple[LocalCluster, Client],
) -> None:
    _, c = filled
    job = c.state(JOB)
    assert (job["stored_bytes"], job["stored_epochs"]) == (JOB_BYTES, JOB_EPOCHS)
    bulk = c.state(BULK)
    assert (bulk["stored_bytes"], bulk["stored_epochs"]) == (BULK_BYTES, BULK_COUNT)
    assert c.status()["stored_bytes"] == {JOB: JOB_BYTES, BULK: BULK_BYTES}


def test_the_metrics_endpoint_exports_them_per_stream_and_domain(
    filled: tuple[LocalCluster, Client],
) -> None:
    cluster, _ = filled
    assert scrape(cluster) == EXPECTED_METRICS


def test_convergencectl_state_status_and_top_show_them(
    filled: tuple[LocalCluster, Client], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _ = filled

    def ctl(*argv: str) -> str:
        capsys.readouterr()
        code = main(["--socket", str(cluster.socket_path(1)), *argv])
        out, err = capsys.readouterr()
        assert (code, err) == (0, ""), err
        return out

    stored = "nvme 125 B in 2 epochs, s3 4.1 KiB in 2 epochs"
    assert f"stored          {stored}\n" in ctl("state", JOB)
    total = sum(JOB_BYTES.values()) + BULK_BYTES["nvme"]
    assert f"stored   {format_bytes(total)} by this node's ranks\n" in ctl("status")
    assert f"stored         {stored}\n" in ctl("top", JOB, "--count", "1", "--no-clear")
    frame = json.loads(ctl("top", JOB, "--count", "1", "--json"))
    assert frame["state"]["stored_bytes"] == JOB_BYTES
    assert frame["state"]["stored_epochs"] == JOB_EPOCHS


def test_a_restart_from_a_compacted_log_keeps_the_figures(
    filled: tuple[LocalCluster, Client],
) -> None:
    cluster, c = filled
    until(lambda: c.status()["counters"].get("wal_compactions", 0) >= 1,
          what="the log to be compacted")  # fmt: skip
    cluster.kill(1, signal.SIGKILL)
    cluster.start(1)
    c = cluster.client(1)
    assert c.state(JOB)["stored_bytes"] == JOB_BYTES
    assert c.state(BULK)["stored_bytes"] == BULK_BYTES
    assert scrape(cluster) == EXPECTED_METRICS


# -- drawn from hand-made maps -----------------------------------------------------------


def test_sizes_are_shown_in_binary_units() -> None:
    shown = [format_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 12_300_000_000, 2**63 - 1)]
    assert shown == ["0 B", "1023 B", "1 KiB", "1.5 KiB", "1 MiB", "11.5 GiB", "8 EiB"]


def test_top_says_unknown_for_a_daemon_that_does_not_report_them() -> None:
    state: dict[str, Any] = {"stream": JOB, "newest": {}, "spec": {
        "name": JOB, "members": {"node-1": [0]}, "retention": 0,
        "policy": {"mode": "all", "domains": ["nvme"]}}}  # fmt: skip
    assert "stored         unknown" in render_top(state, None).splitlines()
    state |= {"stored_bytes": {"nvme": 3 << 30}, "stored_epochs": {"nvme": 1}}
    assert "stored         nvme 3 GiB in 1 epoch" in render_top(state, None).splitlines()
