"""The simulator as a safety net: deterministic, fault-heavy, and able to bite.

The swarm test is the main guard on every protocol change: 450 seeds with every
fault (a quarter of them changing the membership, with two spares),
checked against ground truth after each event. The mutation tests prove the oracle
is not asleep: a deliberately broken merge or GC rule, or a rank that adopts copies
it cannot read, must be caught.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from convergenced.core.agreement import StreamAgreement
from convergenced.core.gate import GatedOutput
from convergenced.core.node import NodeCore
from convergenced.core.records import Record
from convergenced.sim.faults import MEMBERSHIP_FAULTS
from convergenced.sim.runner import replay_command, run_seeds
from convergenced.sim.storage import Storage
from convergenced.sim.world import FAULTS, SimConfig, Simulation

SWARM_SEEDS = 240


def _configs(n: int, start: int = 0, **kw: object) -> list[SimConfig]:
    base = replace(SimConfig(), **kw)  # type: ignore[arg-type]
    return [replace(base, seed=s) for s in range(start, start + n)]


def test_same_seed_gives_the_same_trace_hash() -> None:
    a = Simulation(SimConfig(seed=7)).run()
    b = Simulation(SimConfig(seed=7)).run()
    assert a.trace_hash == b.trace_hash
    assert a.messages == b.messages


def test_different_seeds_give_different_traces() -> None:
    a = Simulation(SimConfig(seed=1)).run()
    b = Simulation(SimConfig(seed=2)).run()
    assert a.trace_hash != b.trace_hash


def test_swarm_of_seeds_with_all_faults_keeps_every_invariant() -> None:
    summary = run_seeds(_configs(SWARM_SEEDS), jobs=2)
    assert summary.failures == []
    assert summary.violations == 0
    assert summary.converged == SWARM_SEEDS
    # Every fault was actually exercised somewhere in the swarm.
    assert set(summary.fault_counts) == set(FAULTS) - {"skew"}


def test_five_nodes_with_crashes_and_partitions_only() -> None:
    configs = _configs(16, start=10_000, nodes=5, faults=frozenset({"crash", "partition"}))
    summary = run_seeds(configs, jobs=2)
    assert summary.failures == []
    assert summary.converged == len(configs)


def test_overlay_cluster_converges_within_two_log_n_rounds() -> None:
    n = 64  # beyond the mesh limit: Chord-finger overlay with relaying
    r = Simulation(
        SimConfig(nodes=n, seed=3, faults=frozenset(), workload=False, safety_us=20_000)
    ).run()
    assert r.violation is None
    assert r.converged
    assert r.rounds_to_converge is not None
    assert r.rounds_to_converge <= 2 * math.ceil(math.log2(n))


def test_membership_faults_move_ranks_and_keep_every_invariant() -> None:
    sims = [Simulation(cfg) for cfg in _configs(8, faults=MEMBERSHIP_FAULTS)]
    results = [sim.run() for sim in sims]
    assert [r.violation for r in results] == [None] * len(sims)
    assert all(r.converged for r in results)
    for sim in sims:
        assert len(sim.ids) == 4 + 2  # the job's nodes and two spares, from the start
        assert sim.placement.same_as(sim.spec.members)  # the last map was declared
    assert set().union(*(r.fault_counts for r in results)) == MEMBERSHIP_FAULTS
    assert any({"n04", "n05"} & set(s.spec.member_ids) for s in sims)  # on a spare
    assert any(s.gone for s in sims)  # a host died for good


def test_convergence_never_restores_an_invalid_epoch_while_the_baselines_do() -> None:
    summary = run_seeds(_configs(20, start=500, compare=frozenset({"marker", "torchtitan"})))
    assert summary.violations == 0
    out = summary.to_json()
    assert out["convergence_samples"] > 0
    assert out["convergence_invalid_restores"] == 0
    for name in ("marker", "torchtitan"):
        assert out[f"{name}_samples"] > 0
        assert out[f"{name}_invalid_restores"] > 0
        assert out[f"{name}_invalid_restores"] == out[f"{name}_mixed"] + out[f"{name}_unreadable"]


# -- the oracle bites -------------------------------------------------------------


def _first_violation(configs: list[SimConfig]) -> str | None:
    for cfg in configs:
        r = Simulation(cfg).run()
        if r.violation is not None:
            return r.violation.invariant
    return None


def test_oracle_catches_a_merge_that_lets_stale_records_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Broken rule: a replayed record overwrites a newer one.
    monkeypatch.setattr(Record, "supersedes", lambda self, other: True)
    found = _first_violation(_configs(30, faults=frozenset({"replay", "crash", "retract"})))
    assert found is not None


def test_oracle_catches_a_gc_rule_that_ignores_retention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = StreamAgreement.gc_horizon

    def too_eager(self: StreamAgreement) -> int | None:
        h = original(self)
        return None if h is None else h + self.spec.retention + 2

    monkeypatch.setattr(StreamAgreement, "gc_horizon", too_eager)
    found = _first_violation(_configs(30, faults=frozenset({"retract"})))
    assert found in {"S1", "S4"}


def test_oracle_catches_a_restore_point_that_ignores_proposals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Broken phase two: take max(CI) without waiting for every member's proposal.
    original = StreamAgreement.decide

    def hasty(self: StreamAgreement, *a: object, **k: object):  # type: ignore[no-untyped-def]
        d = original(self, *a, **k)  # type: ignore[arg-type]
        if d.convergence is not None and d.convergence.max() is not None:
            return replace(d, restore_point=d.convergence.max())
        return d

    monkeypatch.setattr(StreamAgreement, "decide", hasty)
    found = _first_violation(_configs(30, faults=frozenset({"retract", "crash"})))
    assert found is not None


def test_oracle_catches_a_relaunch_that_reuses_its_launchers_counter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Broken rule: every launch uses generation 0, as a launcher's counter does after
    # a requeue or a rerun, and gets the final answer of the first launch.
    monkeypatch.setattr(NodeCore, "next_generation", lambda self, stream: 0)
    found = _first_violation(_configs(20, faults=frozenset({"relaunch"})))
    assert found == "S2"


def test_oracle_catches_a_moved_rank_that_adopts_copies_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Broken adoption: a rank that moved commits, on its new node, the node-local
    # copies it left on the old host's disk, as if it could read them there.
    def anywhere(self: Storage, node: str, rank: int, domain: str) -> set[int]:
        found: set[int] = set()
        for (_, r, d), epochs in self.available.items():
            if (r, d) == (rank, domain):
                found |= epochs
        return found

    monkeypatch.setattr(Storage, "found", anywhere)
    found = _first_violation(_configs(10, faults=frozenset({"replace", "shrink"})))
    assert found == "S1"


# -- the command --------------------------------------------------------------------


def _sim(*args: str, hash_seed: str = "0") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convergenced.cli", "sim", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": hash_seed},
    )


def test_sim_json_reports_the_documented_fields() -> None:
    p = _sim("--nodes", "3", "--seeds", "1", "--seed", "4", "--compare", "all", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("runs", "violations", "converged", "max_rounds_to_converge", "messages",
                "trace_hash", "marker_invalid_restores", "marker_mixed", "marker_unreadable",
                "torchtitan_invalid_restores", "convergence_invalid_restores",
                "lattice"):  # fmt: skip
        assert key in out
    assert out["runs"] == 1 and out["violations"] == 0
    assert set(out["lattice"]) == {"1", "2", "3", "4", "6", "8"}


@pytest.mark.parametrize("faults", ["all", "replace,shrink,grow,leave"])
def test_sim_replays_a_seed_to_the_same_trace_hash_in_another_process(faults: str) -> None:
    # Different string-hash seeds: no set iteration order may leak into the run.
    args = ("--seed", "11", "--faults", faults, "--json", "--no-lattice")
    one = json.loads(_sim(*args, hash_seed="1").stdout.splitlines()[-1])
    two = json.loads(_sim(*args, hash_seed="2").stdout.splitlines()[-1])
    assert one["trace_hash"] == two["trace_hash"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "must be at least 1"),
        (["--nodes", "x"], "is not an integer"),
        (["--faults", "meteor"], "unknown fault 'meteor'"),
        (["--seed", "-1"], "must not be negative"),
        (["--compare", "etcd"], "invalid choice"),
    ],
)
def test_sim_rejects_bad_arguments_with_exit_code_2(args: list[str], message: str) -> None:
    p = _sim(*args)
    assert p.returncode == 2
    assert message in p.stderr


def test_replay_command_names_seed_nodes_and_faults() -> None:
    cmd = replay_command(SimConfig(nodes=5, seed=42, faults=frozenset({"crash", "reset"})))
    assert cmd == "convergenced sim --nodes 5 --seed 42 --faults reset,crash"
    assert "--faults all" in replay_command(SimConfig(seed=1))
    cmd = replay_command(SimConfig(seed=3, faults=frozenset({"leave", "replace"})))
    assert cmd == "convergenced sim --nodes 4 --seed 3 --faults replace,leave"
    both = replay_command(SimConfig(seed=3, compare=frozenset({"marker", "torchtitan"})))
    assert both.endswith("--compare all")


def test_oracle_catches_bytes_that_leave_before_their_fsync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Broken gate: every held chunk leaves at once, fsync or not (what the daemon's
    # peer sessions did when they drained a link after awaiting an earlier fsync).
    def eager(self: GatedOutput) -> list[bytes]:
        out = [data for _, data in self._held]
        self._held.clear()
        return out

    monkeypatch.setattr(GatedOutput, "release", eager)
    found = _first_violation(_configs(10, faults=frozenset({"crash"})))
    assert found == "gate"


def test_driver_upgrades_keep_the_version_handshake_valid_and_live() -> None:
    results = [Simulation(cfg).run() for cfg in _configs(12, faults=frozenset({"upgrade"}))]
    assert [r.violation for r in results] == [None] * len(results)
    assert all(r.converged for r in results)
    assert sum(r.fault_counts.get("upgrade", 0) for r in results) > 10


def test_the_version_oracle_catches_a_version_acknowledged_that_a_member_never_accepted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A core that commits one version more than a node reported accepting."""
    from convergenced.core.interval_set import IntervalSet
    from convergenced.core.versions import Catalogue

    honest = Catalogue.indices

    def one_more(self: Catalogue, versions: object) -> IntervalSet:
        held = honest(self, versions)  # type: ignore[arg-type]
        top = held.max()
        return held if top is None or top + 1 >= len(self.versions) else held.add(top + 1)

    monkeypatch.setattr(Catalogue, "indices", one_more)
    results = [Simulation(cfg).run() for cfg in _configs(10, faults=frozenset({"upgrade"}))]
    assert any(r.violation is not None and r.violation.invariant == "V1" for r in results)


def test_a_gated_rollout_never_runs_incompatible_versions_and_loses_less_than_naive() -> None:
    from convergenced.sim.rollouts import STRATEGIES

    by = {}
    for strategy in STRATEGIES:
        summary = run_seeds(_configs(12, start=700, rollout=strategy))
        assert summary.failures == [], strategy
        by[strategy] = summary.compare
    gated, naive = by["gated"], by["naive"]
    assert gated["rollout_drains"] > 0 and gated["rollout_incompatible"] == 0
    assert naive["rollout_incompatible"] > 0
    per_drain = {s: c["rollout_lost_epochs"] / c["rollout_drains"] for s, c in by.items()}
    assert per_drain["gated"] < per_drain["naive"] and per_drain["gated"] < per_drain["flip"]


def test_the_rollout_comparison_prints_one_row_per_strategy() -> None:
    p = _sim("--seeds", "2", "--seed", "40", "--rollout", "--faults", "crash")
    rows = p.stdout.splitlines()
    assert rows[1].split()[:2] == ["strategy", "runs"]
    assert [r.split()[0] for r in rows[2:5]] == ["naive", "flip", "gated"]
    assert "--rollout gated" in replay_command(SimConfig(seed=3, rollout="gated"))


# -- regressions --------------------------------------------------------------------


@pytest.mark.parametrize("dies_first", [True, False], ids=["dies-first", "restarts-first"])
def test_a_host_dead_for_good_keeps_no_node_that_lost_its_state_waiting(
    dies_first: bool,
) -> None:
    """A node that lost its state waits to hear from every peer it is configured to
    link to (PROTOCOL.md 13.9, rule 2). A member whose host then dies for good never
    speaks again: the operator takes it out of the others' configuration and reloads
    them (docs/operations.md), and the simulator must do so too, or the node never
    answers `next_generation` and no relaunch can move the job off the dead host
    (seed 1572 with upgrade: S5, both hosts left to the job waiting for a third)."""
    from convergenced.sim.network import STREAM

    sim = Simulation(SimConfig(nodes=4, seed=0, faults=frozenset(), workload=False))
    sim._start()
    loop = sim.loop
    loop.run_until(60_000)
    assert all(STREAM in n.core.streams() for n in sim.nodes.values() if n.core)
    sim.lose_state("n01")
    if dies_first:
        sim.gone_for_good("n03")
        sim.restart("n01")
    else:  # n03 is down when n01 comes back, and dies while n01 waits for it
        sim.crash("n03")
        sim.restart("n01")
        loop.run_until(loop.now + 60_000)
        core = sim.nodes["n01"].core
        assert core is not None and core.waiting_to_freeze(STREAM) == ("n03",)
        sim.gone_for_good("n03")
    loop.run_until(loop.now + 60_000)
    core = sim.nodes["n01"].core
    assert core is not None
    assert core.waiting_to_freeze(STREAM) == ()
    assert core.next_generation(STREAM) is not None


def test_seed_1572_with_upgrades_relaunches_off_a_dead_host_and_converges() -> None:
    faults = frozenset(FAULTS) - {"delay", "clog", "pause", "skew", "replay"}
    r = Simulation(SimConfig(nodes=4, seed=1572, faults=faults)).run()
    assert r.violation is None
    assert r.converged
