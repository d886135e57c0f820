"""The marker on PyTorch DCP steps: a real ``dcp.save`` counts, a torn one does not.

One real daemon, one rank, a single-process ``dcp.save`` (no process group), and the
marker driven in-process with its own clock.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from daemons import LocalCluster

from convergenced.markers.layouts import DcpLayout, World
from convergenced.markers.marker import Marker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_whole_dcp_step_is_committed_and_a_torn_one_is_not(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint import state_dict_saver as dcp

    root = tmp_path / "ckpt"
    for step in (5, 10):
        with warnings.catch_warnings():  # "assuming ... to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"w": torch.arange(4096, dtype=torch.float32)},
                     checkpoint_id=str(root / f"step-{step}"))  # fmt: skip
    data = sorted((root / "step-10").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])  # a writer died half way through
    with LocalCluster(1) as cluster:
        cluster.start_all()
        client = cluster.client(1)
        LocalCluster.declare_solo(client, "job", "nvme", retention=100)
        clock = Clock()
        m = Marker(client, DcpLayout(World()), root, stream="job", ranks=[0], domain="nvme",
                   settle=1.0, clock=clock)  # fmt: skip
        m.poll()
        clock.now += 1.0
        report = m.poll()
        assert report.committed == [5]
        assert "bytes, the metadata needs" in report.waiting[10]
        assert client.state("job")["recoverable"] == [[5, 5]]
        digest, size = m.committed[5].digests[0]
        assert digest.startswith("sha256:") and size == sum(
            p.stat().st_size for p in (root / "step-5").iterdir()
        )
        for _ in range(20):
            if (root / "latest").exists():
                break
            clock.now += 0.5
            m.poll()
        assert (root / "latest").read_text() == "step-5"
