"""The scale benchmark's quick mode runs end to end: the real simulator at N = 16 and
32, the gossip model up to 256, JSON as the last line of stdout, the Markdown fragment
and the log-log plot written to ``--out``. No speed is asserted (this machine is
noisy); the numbers live in BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CI = os.environ.get("CI") == "true"
REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_scale.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

if importlib.util.find_spec("matplotlib") is None:
    if CI:  # CI installs the dev dependencies: its absence there is a failure
        raise ImportError("CI=true but matplotlib is not importable")
    pytest.skip(
        "bench_scale.py draws its plot with matplotlib (pip install matplotlib)",
        allow_module_level=True,
    )


def test_quick_run_measures_both_sides_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("convergenced", "gossip", "analysis", "verdict", "record_bytes",
                "not_measured", "definitions", "machine", "config"):  # fmt: skip
        assert key in data, key
    assert data["mode"] == "quick"

    rows = data["convergenced"]
    assert [r["nodes"] for r in rows] == [16, 32]
    for r in rows:
        assert r["converged"] == len(r["runs"]) >= 1, r["failures"]
        assert r["rounds_median"] > 0
        assert r["rounds_max"] >= r["rounds_median"]
        assert r["bytes_per_node_median"] > 0
        assert r["messages_per_node_median"] > 0
        for run in r["runs"]:
            # The simulator's own definition: bytes per node per round x rounds.
            assert run["bytes_per_node"] == pytest.approx(
                run["bytes_per_node_per_round"] * run["rounds"], rel=1e-3
            )
    assert data["record_bytes"] > 0

    gossip = data["gossip"]
    assert [g["nodes"] for g in gossip] == [16, 32, 64, 128, 256]
    for g in gossip:
        # Bounded retransmits may miss a few node-update pairs (reported, not patched),
        # but the epidemic reaches nearly everyone, and the counts add up.
        assert g["coverage_min"] >= 0.999, g
        missed = [run for run in g["runs"] if not run["reached_all"]]
        assert g["reached_all_seeds"] == g["seeds"] - len(missed)
        assert all(run["missing_pairs"] > 0 for run in missed)
        for run in g["runs"]:
            if run["reached_all"]:
                assert 0 < run["rounds"] <= run["rounds_to_quiescence"]
                assert run["bytes_per_node"] <= run["bytes_per_node_total"]
    assert gossip[0]["reached_all_seeds"] == gossip[0]["seeds"]
    if any(g["reached_all_seeds"] < g["seeds"] for g in gossip):
        assert "did NOT reach every node" in proc.stdout

    assert data["verdict"].startswith("Verdict: ")
    report = (out / "scale.md").read_text()
    assert report.startswith("Command: `.venv/bin/python benchmarks/bench_scale.py --quick")
    assert data["verdict"] in report
    assert "Definitions." in report
    assert (out / "scale.png").read_bytes().startswith(PNG_SIGNATURE)
