"""A launch whose rank 0's daemon dies before it answers `next_generation` fails.

The answer waits for the write that covers what it reveals, and a crash takes it: the
rank's connection breaks (`new_generation` raises), the launch fails and its launcher
starts the job again. The simulator used to leave such a launch waiting for good, and
with it the declaration of a new member map on a member whose ranks of the launch
before had died: the healed cluster never got quiet (seed 300293, S5: the crash at
the end of the faulty phase took the answer).
"""

from __future__ import annotations

from convergenced.core.facts import Commit
from convergenced.sim.network import STREAM
from convergenced.sim.world import FAULTS, SimConfig, Simulation


def test_a_crash_that_takes_rank_0s_answer_fails_the_launch_and_the_job_starts_again() -> None:
    sim = Simulation(SimConfig(nodes=4, seed=0, faults=frozenset(), workload=False))
    sim._start()
    loop = sim.loop
    loop.run_until(60_000)
    launches = sim.launches
    opener = "n01"
    node = sim.nodes[opener]
    assert node.core is not None and node.gate is not None
    assert STREAM in node.core.streams()
    launches.launch += 1  # a relaunch whose rank 0 runs on n01 and asks now
    launch = launches.launch
    # A commit not yet durable: the answer waits for the write that covers it.
    rank = sim.spec.ranks_of(opener)[0]
    assert sim.submit(opener, Commit(STREAM, rank, sim.domains[0].name, 1)) is None
    launches._open(opener, launch, 1)
    assert node.replies, "the answer waits for the write"
    assert launch not in launches.generation_of
    sim.crash(opener)
    assert launches.launch == launch + 1, "the launch failed and the job started again"
    sim.restart(opener)
    loop.run_until(loop.now + 200_000)
    assert launch not in launches.generation_of
    assert launch + 1 in launches.generation_of, "the new launch handed its number out"


def test_seed_300293_converges() -> None:
    r = Simulation(SimConfig(nodes=4, seed=300293, faults=frozenset(FAULTS))).run()
    assert r.violation is None
    assert r.converged
