"""`convergenced demo`: the whole story on real daemons (quick settings), its JSON, its
output, its option checks, and the determinism the bit-for-bit check relies on; and the
``replace`` scenario, where a spare takes over the rank of a host gone for good."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from convergenced.tools import demo


def test_demo_json_verifies_bit_for_bit() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "convergenced.tools.demo", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)  # stdout holds exactly the JSON object
    assert result["verified"] is True
    assert result["bitwise_equal"] is True
    assert result["final_digest"] == result["reference_digest"]
    # node-3 died writing epoch 12 (24 steps, a checkpoint every 4): every rank
    # restored epoch 8, while rank 0's latest marker pointed at the unfinished 12.
    assert result["crash_epoch"] == 12
    assert result["restore_point"] == 8
    assert result["restored"] == {"node-1": 8, "node-2": 8, "node-3": 8}
    assert result["final_restore_point"] == 24
    assert result["marker_epoch"] == 12
    assert result["marker_valid"] is False
    assert result["marker_missing_ranks"] == [2]
    assert "mixed epochs" in result["marker_error"]
    assert result["marker_bitwise_equal"] is False
    assert result["elapsed_s"] < 60
    assert sorted(result["metrics"]) == ["node-1", "node-2", "node-3"]
    assert result["scenario"] == "restart" and result["launch"] is None
    assert result["restored_from"] == {"node-1": "nvme", "node-2": "nvme", "node-3": "nvme"}
    assert "VERIFIED" in proc.stderr  # progress and verdict go to stderr with --json


def test_demo_replace_restores_the_dead_hosts_rank_on_the_spare_bit_for_bit() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "convergenced.tools.demo", "--quick", "--scenario", "replace",
         "--json"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["verified"] is True and result["scenario"] == "replace"
    assert result["bitwise_equal"] is True
    assert result["final_digest"] == result["reference_digest"]
    # node-3 died writing epoch 12 while its upload of 8 was on its way, its disk with
    # it: the shared tier held rank 2 up to 4, which every rank restored, rank 2 on
    # node-4 from s3 (adopted there), the others from their nvme.
    assert result["restore_point"] == 4
    assert result["restored"] == {"node-1": 4, "node-2": 4, "node-4": 4}
    assert result["restored_from"] == {"node-1": "nvme", "node-2": "nvme", "node-4": "s3"}
    assert result["members"] == {"node-1": [0], "node-2": [1], "node-4": [2]}
    assert result["launch"] == {"generation": 1, "membership": 1}  # a new member map
    assert result["adopted"] == [4]
    assert result["final_restore_point"] == 24
    assert result["marker_epoch"] == 12 and result["marker_missing_ranks"] == [2]
    assert "rank 2 at epoch 4" in result["marker_error"]
    assert sorted(result["metrics"]) == ["node-1", "node-2", "node-3", "node-4"]
    assert "spare node-4 took over rank 2 from the shared tier" in proc.stderr


def test_demo_in_process_prints_progress_and_cleans_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = set(Path("/tmp").glob("cvg-demo-*"))
    assert demo.run_demo(["--quick", "--crash-at", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any("Prometheus can scrape: http://127.0.0.1:" in line for line in lines)
    assert any("CRASH: node-3" in line for line in lines)
    assert any("node-1 nvme" in line and "skew" in line for line in lines)
    assert "restore point is epoch 4" in out
    assert lines[-1].startswith("VERIFIED: ")
    assert "\x1b[" not in out  # not a terminal: plain lines, no cursor control
    assert set(Path("/tmp").glob("cvg-demo-*")) == before  # the directory is gone


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--every", "0"], "--every 0"),
        (["--steps", "5", "--every", "2"], "--steps 5"),
        (["--crash-at", "13", "--quick"], "--crash-at 13"),
        (["--crash-at", "4", "--quick"], "--crash-at 4"),
        (["--crash-at", "8", "--quick", "--scenario", "replace"], "from 12 to below 24"),
    ],
)
def test_bad_options_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.run_demo(argv) == 2
    assert message in capsys.readouterr().err


def test_training_is_deterministic_and_resumable() -> None:
    steps = 12
    reference = demo.reference_run(steps)
    assert demo.reference_run(steps) == reference
    # Resuming from any step's full state reproduces the run bit for bit.
    shards = [demo.init_shard(r) for r in range(demo.NODES)]
    for step in range(5):
        full = [w for s in shards for w in s]
        shards = [demo.train_step(full, step, r) for r in range(demo.NODES)]
    resumed = [demo.unpack(demo.pack(s)) for s in shards]
    for step in range(5, steps):
        full = [w for s in resumed for w in s]
        resumed = [demo.train_step(full, step, r) for r in range(demo.NODES)]
    assert [demo.pack(s) for s in resumed] == reference
    start = [w for r in range(demo.NODES) for w in demo.init_shard(r)]
    final = [w for s in reference for w in demo.unpack(s)]
    assert demo.loss(final, steps) < demo.loss(start, 0)
