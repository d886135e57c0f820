"""The simulator with CA-bound trust: credentials gossiped by the core's own book and
exchange, records signed and checked against them, identity keys lost with the
incarnation floor (`convergenced.sim.trust`).

A node that loses its identity key, its floor and its state must still learn its
earlier life from its records that peers hold, which its old key signed: it learns
that key from its old credential, which peers send back. The swarm holds every
invariant with that; the two mutation tests show the simulator notices when either
half of the mechanism is missing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from convergenced.core.credentials import CredentialExchange
from convergenced.sim import trust
from convergenced.sim.runner import replay_command, run_seeds
from convergenced.sim.world import SimConfig, Simulation

SEEDS = 120


def test_a_swarm_with_credentials_keeps_every_invariant() -> None:
    base = SimConfig(credentials=True)
    summary = run_seeds([replace(base, seed=s) for s in range(1000, 1000 + SEEDS)], jobs=2)
    assert summary.failures == []
    assert summary.converged == SEEDS
    # Keys were lost and records refused on the way (the faults bit), yet all agreed.
    assert summary.refused_records > 0
    assert "--credentials" in replay_command(base)


def test_without_the_replaced_credential_sent_back_a_node_stays_below_its_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seed 1169: a node loses its key twice, the second time with a new certificate.
    cfg = SimConfig(seed=1169, credentials=True)
    assert Simulation(cfg).run().converged
    monkeypatch.setattr(CredentialExchange, "peer_is", lambda self, peer: None)
    r = Simulation(cfg).run()
    assert r.violation is not None and r.violation.invariant == "S5"


def test_without_the_keys_of_its_earlier_lives_a_node_cannot_read_its_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = SimConfig(seed=1001, credentials=True)
    assert Simulation(cfg).run().converged
    forgetful = property(lambda self: set(), lambda self, keys: None)
    monkeypatch.setattr(trust.SimTrust, "past_keys", forgetful, raising=False)
    r = Simulation(cfg).run()
    assert r.violation is not None and r.violation.invariant == "S5"
