"""Smoke runs of the comparative benchmarks (``--quick``), so `make bench` cannot rot:
each script runs end to end against real daemons (and a real etcd), prints its JSON
and writes its BENCHMARKS.md fragment. No speed is asserted here (this machine is
noisy); the numbers live in BENCHMARKS.md, from `make bench`.

etcd comes from the Debian package ``etcd-server`` (installed by ``.ci/run``); without
it the etcd smoke run skips, except under ``CI=true``, where a missing tool fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
IN_CI = os.environ.get("CI") == "true"
PNG = b"\x89PNG\r\n\x1a\n"

sys.path.insert(0, str(BENCH))
import report  # noqa: E402


def _run(script: str, *args: str, out: Path, timeout: float = 120) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", "--out", str(out), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _fragment(out: Path, name: str, script: str) -> str:
    text = (out / f"{name}.md").read_text()
    assert text.startswith(f"Command: `.venv/bin/python benchmarks/{script} --quick")
    assert "```" in text
    return text


def test_etcd_pattern_against_convergenced_smoke(tmp_path: Path) -> None:
    if shutil.which("etcd") is None:
        reason = "etcd not installed (Debian package 'etcd-server')"
        if IN_CI:
            pytest.fail(reason + ", required under CI")
        pytest.skip(reason)
    data = _run("bench_etcd.py", out=tmp_path)
    assert [r["members"] for r in data["etcd"]] == [1]
    assert [r["nodes"] for r in data["convergenced"]] == [3]
    for side in (data["etcd"][0], data["convergenced"][0]):
        assert side["samples"] > 0
    assert data["ratios"][0]["e2e_p50_ratio"] > 0
    text = _fragment(tmp_path, "etcd", "bench_etcd.py")
    assert "convergenced (TLS)" in text and "etcd, 1 member(s)" in text
    assert (tmp_path / "etcd.png").read_bytes().startswith(PNG)


def test_local_api_with_and_without_group_commit_smoke(tmp_path: Path) -> None:
    data = _run("bench_daemon.py", "--only", "throughput", out=tmp_path)
    results = {r["key"]: r for r in data["throughput"]["results"]}
    grouped = results["throughput.group_k64_c64"]
    plain = results["throughput.ungrouped_k64_c64"]
    assert grouped["commits_per_s_median"] > 0 and plain["commits_per_s_median"] > 0
    # The knob really changes the log: one fsync per commit without grouping, several
    # commits per fsync with it (64 concurrent committers).
    assert plain["commits_per_fsync"] == pytest.approx(1.0, abs=0.05)
    assert grouped["commits_per_fsync"] > 2
    assert "NO group commit" in _fragment(tmp_path, "localapi", "bench_daemon.py")


def test_footprint_smoke(tmp_path: Path) -> None:
    data = _run("bench_footprint.py", out=tmp_path)
    idle, load = data["phases"]
    assert (idle["name"], load["name"]) == ("idle", "load")
    assert idle["commits_per_s"] == 0 and load["commits_per_s"] > 0
    for phase in (idle, load):
        assert 0 < phase["cpu_share_median"] <= phase["cpu_share_max"]
        assert 10 < phase["rss_mib_median"] <= phase["rss_mib_max"] < 1024
        assert phase["frames_per_s_median"] > 0  # heartbeats at least
    assert load["restore_point_lag"] and max(load["restore_point_lag"]) >= 0
    _fragment(tmp_path, "footprint", "bench_footprint.py")


def test_frames_smoke(tmp_path: Path) -> None:
    data = _run("bench_frames.py", out=tmp_path)
    assert data["floor_us"] > 0 and data["peer_us"] > 0
    assert len(data["runs"]["peer_us"]) == 1
    assert "peer path / floor" in _fragment(tmp_path, "frames", "bench_frames.py")


def test_rollout_smoke(tmp_path: Path) -> None:
    data = _run("bench_rollout.py", "--jobs", "1", out=tmp_path)
    assert data["violations"] == 0
    assert set(data["strategies"]) == {"naive", "flip", "gated"}
    assert all(s["rollout_samples"] > 0 for s in data["strategies"].values())
    assert "epochs lost/drain" in _fragment(tmp_path, "rollout", "bench_rollout.py")


def test_fleet_smoke(tmp_path: Path) -> None:
    data = _run("bench_fleet.py", out=tmp_path)
    assert data["nodes"] == 4 and data["refused"] == 0
    assert set(data["phases"]) == {"links up", "agreed", "spares linked", "agreed again"}
    assert "spares linked" in _fragment(tmp_path, "fleet", "bench_fleet.py")


def test_report_splices_fragments_between_markers_and_nothing_else() -> None:
    doc = (
        "# Title\nprose stays\n<!-- bench:etcd -->\nold table\n<!-- /bench:etcd -->\n"
        "more prose\n<!-- bench:scale -->\nold\n<!-- /bench:scale -->\n"
    )
    text, done = report.splice(doc, {"etcd": "new table\n"})
    assert done == ["etcd"]
    assert text == doc.replace("old table\n", "new table\n")
    assert report.command_line(str(BENCH / "bench_etcd.py"), ["--out", "x", "--json", "-q"]) == (
        ".venv/bin/python benchmarks/bench_etcd.py -q"
    )


def test_benchmarks_md_has_a_marker_for_every_fragment_make_bench_writes() -> None:
    makefile = (REPO / "Makefile").read_text()
    doc = (REPO / "BENCHMARKS.md").read_text()
    for name in ("etcd", "training", "training-drift", "localapi", "scale", "footprint", "frames",
                 "rollout", "fleet", "churn"):  # fmt: skip
        assert f"<!-- bench:{name} -->" in doc and f"<!-- /bench:{name} -->" in doc, name
    for script in (
        "bench_etcd",
        "bench_training",
        "bench_daemon",
        "bench_scale",
        "bench_footprint",
        "bench_frames",
        "bench_rollout",
        "bench_fleet",
        "bench_churn",
    ):
        assert f"benchmarks/{script}.py" in makefile, script
