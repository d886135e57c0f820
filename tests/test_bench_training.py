"""The training benchmark's quick mode runs end to end: a real gloo job of two workers
against two real daemons, JSON as the last line of stdout, the Markdown fragment and
the chart written to ``--out``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CI = os.environ.get("CI") == "true"
SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_training.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_missing = [m for m in ("torch", "matplotlib") if importlib.util.find_spec(m) is None]
if _missing:
    if CI:  # CI installs both: their absence there is a failure
        raise ImportError(f"CI=true but not importable: {', '.join(_missing)}")
    pytest.skip(
        f"bench_training.py needs {' and '.join(_missing)} (pip install torch==2.13.0 matplotlib)",
        allow_module_level=True,
    )


def test_quick_run_reports_both_variants_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["mode"] == "quick"
    [result] = data["results"]
    assert result["nodes"] == 2
    for variant in (
        "barrier_marker",
        "barrier_marker_barrier",
        "convergenced",
        "convergenced_nowait",
    ):
        blocked = result["variants"][variant]["blocked"]
        assert blocked["n"] == 2 * data["config"]["checkpoints"], variant
        assert blocked["p50_s"] > 0, variant
        assert blocked["p99_s"] >= blocked["p50_s"], variant
    assert result["ratios_vs_convergenced"]["barrier_marker"]["p50"] > 0
    assert isinstance(result["target_met"], bool)
    assert data["verdict"].startswith("Verdict: ")

    report = (out / "training.md").read_text()
    assert "Command (" in report and "benchmarks/bench_training.py --quick\n" in report
    assert data["verdict"] in report
    assert (out / "training.png").read_bytes().startswith(PNG_SIGNATURE)
