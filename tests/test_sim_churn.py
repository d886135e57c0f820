"""Membership churn at fixed times (``SimConfig.churn``, ``convergenced sim --churn K``).

The scale benchmark with churn (`benchmarks/bench_churn.py`) compares N by making the
same number of membership changes at every N. These tests pin what that rests on: the
plan cycles through the enabled kinds, the cluster has the spares the plan needs, every
planned change really moves a node, the oracle holds and the run converges, a run
without churn is the run it was before, and a failing seed's replay line carries the
flag.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from convergenced.sim.faults import MEMBERSHIP_FAULTS, churn_plan, churn_spares
from convergenced.sim.runner import replay_command
from convergenced.sim.world import SimConfig, Simulation

REPO = Path(__file__).resolve().parent.parent


def test_the_plan_cycles_through_the_enabled_membership_faults() -> None:
    assert churn_plan(MEMBERSHIP_FAULTS, 6) == [
        "replace", "shrink", "grow", "leave", "replace", "shrink",
    ]  # fmt: skip
    assert churn_plan(frozenset({"crash", "leave", "grow"}), 3) == ["grow", "leave", "grow"]
    assert churn_plan(frozenset({"crash"}), 4) == []
    assert churn_plan(MEMBERSHIP_FAULTS, 0) == []
    # Each replace needs a spare that never hosted ranks, and a grow may take one first.
    assert churn_spares(churn_plan(MEMBERSHIP_FAULTS, 8)) == 4


def test_every_planned_change_moves_a_node_and_the_oracle_holds() -> None:
    cfg = SimConfig(nodes=8, seed=5, faults=MEMBERSHIP_FAULTS, workload=False, churn=8)
    sim = Simulation(cfg)
    r = sim.run()
    assert r.violation is None
    assert r.converged
    assert len(sim.ids) == 8 + 4  # the spares the plan needs
    assert r.fault_counts == {"replace": 2, "shrink": 2, "grow": 2, "leave": 2}
    assert sim.faults.skipped == 0
    # replace: one in, one out; shrink and leave: one out; grow: one in.
    assert sim.faults.joined >= 4 and sim.faults.left >= 4
    assert len(sim.gone) >= 2  # both replaced hosts died for good
    assert sim.launches.launch >= 8


def test_without_churn_the_membership_faults_keep_their_drawn_rates() -> None:
    sim = Simulation(SimConfig(seed=3, faults=MEMBERSHIP_FAULTS))
    assert sim.faults.plan == []
    assert all(sim.faults.rates[f] > 0 for f in MEMBERSHIP_FAULTS)
    assert len(sim.ids) == 4 + 2
    churned = Simulation(SimConfig(seed=3, faults=MEMBERSHIP_FAULTS, churn=4))
    assert all(churned.faults.rates[f] == 0 for f in MEMBERSHIP_FAULTS)
    # The other faults' rates are those of the same seed without churn.
    assert {f: r for f, r in churned.faults.rates.items() if f not in MEMBERSHIP_FAULTS} == {
        f: r for f, r in sim.faults.rates.items() if f not in MEMBERSHIP_FAULTS
    }


def test_the_replay_line_carries_the_churn() -> None:
    cfg = SimConfig(nodes=64, seed=2, faults=MEMBERSHIP_FAULTS, workload=False, churn=8)
    assert replay_command(cfg) == (
        "convergenced sim --nodes 64 --seed 2 --faults replace,shrink,grow,leave "
        "--no-workload --churn 8"
    )


def _sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.cli", "sim", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_command_runs_a_churn_and_refuses_one_without_a_membership_fault() -> None:
    p = _sim("--nodes", "6", "--seed", "1", "--faults", "shrink,grow", "--churn", "4",
             "--no-workload", "--json", "--no-lattice")  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    assert out["violations"] == 0 and out["converged"] == 1
    assert out["fault_counts"] == {"grow": 2, "shrink": 2}
    p = _sim("--faults", "crash", "--churn", "4")
    assert p.returncode == 2
    assert "--churn needs a membership fault" in p.stderr


def test_the_churn_benchmark_prints_a_row_per_run_and_the_fragment(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_churn.py"), "--nodes", "6", "8",
         "--churn", "4", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    data = json.loads(p.stdout.strip().splitlines()[-1])
    assert [r["nodes"] for r in data["runs"]] == [6, 8]
    for r in data["runs"]:
        assert r["violation"] is None and r["converged"]
        assert sum(r["changes"].values()) == 4
        assert r["rounds"] is not None and r["rounds"] <= r["rounds_bound"]
        assert r["replay"].endswith("--no-workload --churn 4")
    fragment = (tmp_path / "churn.md").read_text()
    assert "bench_churn.py --nodes 6 8 --churn 4" in fragment
    assert "changes r/s/g/l" in fragment
