"""A daemon stalled again while stalled stays stalled until the first stall ends.

The ``pause`` fault stalls a daemon; what its clients submit meanwhile is taken when it
resumes, in the order they submitted it. A second stall used to replace the first's
end with its own, which could be earlier: the requests that waited for the first end
were then taken after those that arrived since, and a driver report the hook had
replaced came back as the node's last word (seed 442411, S5: the version handshake
waited for a report the node had already replaced).
"""

from __future__ import annotations

from convergenced.sim.world import FAULTS, SimConfig, Simulation


def test_a_second_pause_never_ends_the_first_early() -> None:
    sim = Simulation(SimConfig(nodes=4, seed=0, faults=frozenset({"pause"})))
    sim._start()
    sim.loop.run_until(50_000)
    node = sim.nodes["n01"]
    for _ in range(200):  # pause n01 again and again, whatever each draw gives
        sim.faults._alive = lambda: ["n01"]  # type: ignore[method-assign]
        before = node.paused_until
        sim.faults._pause()
        assert node.paused_until >= before
        assert node.paused_until > sim.loop.now


def test_seed_442411_converges() -> None:
    r = Simulation(SimConfig(nodes=4, seed=442411, faults=frozenset(FAULTS))).run()
    assert r.violation is None
    assert r.converged
