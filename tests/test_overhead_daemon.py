"""The checkpoint overhead figure on a real daemon: ranks save through the files
integration, which times each save and reports it over the daemon's Unix socket;
the figure shows in ``state``, ``convergencectl state`` and on /metrics, the worst
rank setting it. Bad reports are refused, named and counted, and change nothing."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemons import LocalCluster, until

from convergenced.core.local_api_codec import ApiError
from convergenced.integrations.files import CheckpointStore, Tier

STREAM = "job"
GAUGE = f'convergenced_checkpoint_overhead_ratio{{stream="{STREAM}"}}'


def test_saves_timed_by_the_integration_give_the_overhead_figure(tmp_path: Path) -> None:
    with LocalCluster(1) as cluster:
        cluster.start_all()
        client = cluster.client(1)
        cluster.declare_solo(client, STREAM, "nvme", ranks=2)
        stores = [CheckpointStore(client, STREAM, r, Tier("nvme", tmp_path)) for r in range(2)]
        assert client.state(STREAM)["overhead"] is None
        assert GAUGE not in cluster.metrics(1)

        for epoch in range(1, 5):
            for store in stores:
                store.save(epoch, b"x" * 4096)
            time.sleep(0.05)  # the training steps between two saves
        until(lambda: (client.state(STREAM)["overhead"] or {}).get("ranks") == 2)
        o = client.state(STREAM)["overhead"]
        assert o["saves"] == 3 and 0 < o["ratio"] < 1, o
        assert o["interval_s"] >= 0.05 and 0 < o["blocking_s"] < o["interval_s"]
        figure = cluster.metrics(1)[GAUGE]
        assert 0 < figure < 1

        # A rank whose saves block for half its interval sets the figure.
        for blocking, interval in ((5.0, None), (5.0, 10.0), (5.0, 10.0)):
            client.report_save(STREAM, 1, blocking, interval)
        o = client.state(STREAM)["overhead"]
        # Its three timed cycles count beside the two new ones: just under 10 s of 20.
        assert o["rank"] == 1 and 0.4 < o["ratio"] < 0.5, o
        assert cluster.metrics(1)[GAUGE] == pytest.approx(o["ratio"])
        out = subprocess.run(
            [sys.executable, "-m", "convergenced.ctl", "--socket", str(cluster.socket_path(1)),
             "state", STREAM],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        assert "save overhead" in out and "rank 1" in out, out

        # Refused, named and counted; nothing kept.
        before = cluster.metrics(1)
        for args, reason in (
            ((STREAM, 7, 1.0, 10.0), "unknown_rank"),
            (("nosuch", 0, 1.0, 10.0), "unknown_stream"),
            ((STREAM, 0, -1.0, 10.0), "bad_request"),
            ((STREAM, 0, 1.0, float("nan")), "bad_request"),
        ):
            with pytest.raises(ApiError) as info:
                client.report_save(*args)
            assert info.value.reason == reason
        assert client.state(STREAM)["overhead"]["ratio"] == pytest.approx(o["ratio"])
        after = cluster.metrics(1)
        for reason, count in (("unknown_rank", 1), ("unknown_stream", 1), ("bad_request", 2)):
            key = f'convergenced_api_errors_total{{reason="{reason}"}}'
            assert after[key] - before.get(key, 0.0) == count, key

        # Undeclared, the stream's figure goes with it.
        for store in stores:
            store.close()
        client.undeclare(STREAM)
        cluster.declare_solo(client, "other", "nvme")
        client.report_save("other", 0, 1.0, None)
        assert GAUGE not in cluster.metrics(1)
